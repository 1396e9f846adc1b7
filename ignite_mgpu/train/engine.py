"""Engine factories: ``create_trainer`` and ``create_evaluator`` return plain ignite Engines for your own code: one
training step with switches (precision, accumulation, clipping), one evaluation step."""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import DeterministicEngine, Engine, Events
from ignite.metrics import Accuracy, Loss, Metric
from torch import nn

from ignite_mgpu.checkpoint.files import native_rng_states, plain_rng_states
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import batches, plugins
from ignite_mgpu.train.fsdp import attach_even_forwards, find_fsdp, no_sync_of
from ignite_mgpu.train.guard import TrainingGuard, accumulation_window
from ignite_mgpu.train.strategy import find_ddp, reduce_replica_losses, unwrap

Batch = Any
PRECISIONS = ("fp32", "bf16", "fp16")
FP16_DEVICE_TYPES = ("cuda",)  # fp16 needs a GradScaler, which PyTorch ships for CUDA; bf16 is the CPU's choice


def use_deterministic_algorithms() -> None:
    """PyTorch's deterministic mode, strict: an operation without a deterministic kernel raises instead of warning.

    cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` for determinism and reads it when it starts (at the first matmul on
    the GPU): set here unless the user chose a value. ignite's ``DeterministicEngine`` switches the mode to
    ``warn_only`` when a run starts on CUDA; ``PortableDeterministicEngine`` switches it back.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


class Scaler(torch.amp.GradScaler):
    """GradScaler that keeps its initial state when the checkpoint holds none: a run saved in fp32 (a disabled
    scaler saves ``{}``) may resume in fp16 (``checkpoint.allow_config_change``), where GradScaler would raise."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict or not self.is_enabled():
            super().load_state_dict(state_dict)


def _under_autocast(forward: Callable[..., Any], precision: str, device: torch.device) -> Callable[..., Any]:
    """``forward`` run under autocast for bf16/fp16; for fp32 ``forward`` itself, so no context is entered."""
    if precision == "fp32":
        return forward
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)(forward)  # an autocast also decorates


def create_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor] | None,
    *,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    grad_accum_steps: int = 1,
    clip_grad_norm: float | None = None,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    deterministic: bool = False,
    check_every: int = 0,
    checkpoint_every: int = 0,
    checkpoint_minutes: float | None = None,
    non_blocking: bool = True,
) -> Engine:
    """A trainer Engine for a model already placed by ``prepare_model`` (DDP, DataParallel, FSDP or plain).

    Each iteration: the batch to the device (every tensor in it; on the CPU it is used as the loader gives it, in CPU
    memory), forward under autocast, ``loss / grad_accum_steps`` backward (on accumulation steps inside DDP's
    ``no_sync``, or FSDP's gradient sync off), then on the last micro-batch unscale, clip (the global norm, also over
    FSDP's shards), optimizer and scheduler step. Windows restart every epoch; when the epoch length does not divide,
    the epoch's last window is shorter and its loss is divided by its own length, so its gradient is the mean over its
    micro-batches. A batch is ``(inputs, targets, *extra)`` or a mapping (targets under "labels" or "targets", the rest
    passed as the model's keyword arguments); ``loss_fn(predictions, targets)`` gets a tensor output or its ``logits``.
    With ``loss_fn=None`` the model computes the loss itself: ``model(x, y)``, or ``model(**batch)`` for a mapping,
    returning the loss, a mapping with "loss" or an object with ``.loss`` (as Hugging Face models do); DataParallel's
    per-GPU loss vector is reduced exactly. ``engine.state.output`` is the detached loss; a ``TrainingGuard`` stops
    every rank together on a non-finite loss or a stop signal, and the sampler's ``set_epoch`` is called every epoch.

    Args:
        precision: "fp32", "bf16" (autocast on CUDA and CPU) or "fp16" (CUDA only, with a GradScaler).
        deterministic: ignite's DeterministicEngine (seeded per iteration; exact mid-epoch resume) and PyTorch's
            strict deterministic mode, with ``CUBLAS_WORKSPACE_CONFIG`` set unless you set it.
        check_every: iterations between the guard's collective checks; 0 (default): about once a second, an
            interval the ranks agree on from their measured step times. Rounded to ``grad_accum_steps``.
        checkpoint_every: the iteration interval of your checkpoint handler, if any: the guard checks on those
            iterations too, so no checkpoint is saved after an unchecked non-finite loss. 0: none.
        checkpoint_minutes: also fire ``GuardEvents.CHECKPOINT`` about this often (the ranks agree at a check);
            it fires for ``checkpoint_every`` too, at the end of the accumulation window holding the multiple.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {PRECISIONS}.")
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps}: use 1 (no accumulation) or more.")
    device = torch.device(device) if device is not None else idist.device()
    if precision == "fp16" and device.type not in FP16_DEVICE_TYPES:
        raise ValueError("precision='fp16' needs CUDA (a GradScaler); on the CPU use precision='bf16'.")
    if deterministic:
        use_deterministic_algorithms()
    fp16 = precision == "fp16"
    scaler = Scaler(device.type, enabled=fp16)
    # GradScaler skips the optimizer step when the scaled gradients overflowed (normal in the first steps of fp16):
    # the schedule must then not advance either. A post-step hook tells, without a host-device sync.
    stepped = [True]
    if fp16 and lr_scheduler is not None:
        optimizer.register_step_post_hook(lambda *_: stepped.__setitem__(0, True))
    # DDP all-reduces (FSDP reduce-scatters) gradients in every backward; on accumulation steps that traffic is
    # wasted, so skip it.
    ddp, fsdp = find_ddp(model), find_fsdp(model)
    no_sync = ddp.no_sync if ddp is not None else no_sync_of(fsdp) if fsdp is not None else contextlib.nullcontext
    parameters = [p for p in model.parameters() if p.requires_grad]
    inner = unwrap(model)  # the evaluator switches the unwrapped module to eval mode

    def compute_loss(batch: Batch) -> torch.Tensor:
        if loss_fn is None:  # the model computes its own loss; DataParallel returns one per GPU: weigh them exactly
            out = batches.loss_of(batches.model_loss(model, batch))
            return reduce_replica_losses(out, model, batches.size(batch))
        if not isinstance(batch, (list, tuple)) and isinstance(batch, Mapping):  # the Mapping ABC check is slower
            inputs, targets = batches.split(batch)
            return loss_fn(batches.logits(model(**inputs)), targets)
        out = model(batch[0])
        return loss_fn(out if isinstance(out, torch.Tensor) else batches.logits(out), batch[1])

    compute_loss = _under_autocast(compute_loss, precision, device)  # the backward runs outside autocast

    def forward_backward(batch: Batch, window: int) -> torch.Tensor:
        loss = compute_loss(batch)
        scaled = loss / window if window > 1 else loss  # the window's gradient is the mean over its micro-batches
        (scaler.scale(scaled) if fp16 else scaled).backward()
        return loss

    # A CPU job's batches are in CPU memory already: no per-step walk over the batch to find that out.
    move = device.type != "cpu"

    # Every line in here runs once per iteration (benchmarks/bench_instructions.py counts what they cost): the fp32
    # path enters no context and skips the disabled scaler, and without accumulation the backward is inline.
    def train_step(engine: Engine, batch: Batch) -> torch.Tensor:
        if not inner.training:  # model.train() walks every submodule: only do it after an evaluation
            model.train()
        if move:
            batch = batches.to_device(batch, device, non_blocking)
        if grad_accum_steps == 1:
            loss = compute_loss(batch)
            (scaler.scale(loss) if fp16 else loss).backward()
        else:
            # Windows restart every epoch: an epoch-end checkpoint or stop never holds half a window's gradients.
            last, window = accumulation_window(engine.state.iteration, engine.state.epoch_length, grad_accum_steps)
            if not last:
                with no_sync():  # an accumulation step: gradients stay local until the last micro-batch
                    return forward_backward(batch, window).detach()
            loss = forward_backward(batch, window)
        if clip_grad_norm is not None:
            if fp16:
                scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad_norm)
        if fp16:
            stepped[0] = False
            scaler.step(optimizer)  # skips optimizer.step() when the scaled gradients overflowed
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if lr_scheduler is not None and stepped[0]:
            lr_scheduler.step()
        return loss.detach()

    trainer = PortableDeterministicEngine(train_step) if deterministic else Engine(train_step)
    trainer.logger.setLevel("CRITICAL")  # failures are reported once by the launcher, not by every rank's engine
    trainer.scaler = scaler  # type: ignore[attr-defined]  # checkpoints save and restore it with the trainer
    trainer.add_event_handler(Events.EPOCH_STARTED, _set_sampler_epoch)
    if check_every:  # a stop must fall on an optimizer step, never inside a gradient-accumulation window
        check_every = max(grad_accum_steps, check_every // grad_accum_steps * grad_accum_steps)
    guard = TrainingGuard(
        check_every, sync_every=checkpoint_every, multiple_of=grad_accum_steps, checkpoint_minutes=checkpoint_minutes
    )
    guard.attach(trainer)
    return trainer


def _set_sampler_epoch(engine: Engine) -> None:
    # A DistributedSampler shuffles with seed + epoch; without set_epoch every epoch repeats the same order.
    loader = engine.state.dataloader
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None) or getattr(loader, "sampler", None)
    set_epoch = getattr(sampler, "set_epoch", None)
    if set_epoch is not None:
        set_epoch(engine.state.epoch - 1)


def create_evaluator(
    model: nn.Module,
    metrics: Mapping[str, Metric],
    *,
    model_loss: bool = False,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    non_blocking: bool = True,
) -> Engine:
    """An evaluator Engine whose metrics are reduced over all ranks (ignite metrics all-reduce in ``compute``).

    Each batch's output is ``(predictions, targets)`` for the metrics; with ``model_loss=True`` (the model computes
    its own loss, as ``create_trainer(loss_fn=None)``) it is ``(loss, batch size)``, for ``validation_metrics(None)``.
    It runs the unwrapped module: DDP's forward may broadcast buffers, a collective that would hang when ranks
    hold different numbers of validation batches (the validation sampler does not pad). An FSDP model's every
    forward is a collective: ranks with fewer batches repeat their last one, unscored, until all ran as many.
    """
    device = torch.device(device) if device is not None else idist.device()
    ddp = find_ddp(model)
    net = ddp.module if ddp is not None else model

    def output(batch: Batch) -> tuple[torch.Tensor, Any]:
        if model_loss:
            n = batches.size(batch)
            return reduce_replica_losses(batches.loss_of(batches.model_loss(net, batch)), net, n).float(), n
        inputs, targets = batches.split(batch)
        return batches.logits(batches.predict(net, inputs)).float(), targets

    forward = _under_autocast(output, precision if precision != "fp16" or device.type == "cuda" else "fp32", device)

    @torch.no_grad()
    def eval_step(engine: Engine, batch: Batch) -> tuple[torch.Tensor, Any]:
        return forward(batches.to_device(batch, device, non_blocking))

    evaluator = Engine(eval_step)
    evaluator.add_event_handler(Events.STARTED, lambda: net.eval())  # once per run: eval() visits every submodule
    evaluator.logger.setLevel("CRITICAL")
    if find_fsdp(model) is not None:  # its forward is a collective: as many on every rank, before the metrics reduce
        attach_even_forwards(evaluator, eval_step)
    for name, metric in metrics.items():
        metric.attach(evaluator, name)
    return evaluator


class PortableDeterministicEngine(DeterministicEngine):
    """ignite's ``DeterministicEngine`` whose ``state_dict`` holds its RNG states as tensors and plain Python values:
    a checkpoint of it loads with plain ``torch.load(path, weights_only=True)``, with no numpy globals allowed.
    State dicts in ignite's own form (numpy arrays) still load."""

    def state_dict(self) -> OrderedDict:
        state = super().state_dict()
        state["rng_states"] = plain_rng_states(state["rng_states"])
        return state

    def load_state_dict(self, state_dict: Mapping) -> None:
        state = dict(state_dict)
        if state.get("rng_states") is not None:
            state["rng_states"] = native_rng_states(list(state["rng_states"]))
        super().load_state_dict(state)

    def _init_run(self) -> None:
        super()._init_run()  # on CUDA it sets torch.use_deterministic_algorithms(True, warn_only=True)
        use_deterministic_algorithms()


def validation_metrics(loss_fn: Callable[..., torch.Tensor] | None, device: torch.device) -> dict[str, Metric]:
    """Metrics for ``create_evaluator``, accumulated on ``device`` (ignite keeps them on the CPU by default: a copy to
    the host per validation batch on a GPU): accuracy and loss for cross-entropy; the loss, weighted by the samples
    of every batch (exact over uneven shards), for any other loss function, or for a model that computes its own
    (``loss_fn=None``; pair it with ``create_evaluator(model_loss=True)``)."""
    if loss_fn is None:  # outputs are (mean loss of the batch, its size): the metric sums loss x size over ranks
        return {"loss": Loss(lambda loss, n: loss, batch_size=lambda n: n, device=device)}
    metrics: dict[str, Metric] = {"loss": Loss(loss_fn, device=device)}
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        metrics["accuracy"] = Accuracy(device=device)
    return metrics


def create_loss(name: str) -> Callable[..., torch.Tensor] | None:
    """``train.loss``: "cross_entropy", "model" (None: the model computes its own), or a factory of the user's
    ("package.module:factory") that returns a loss function ``(predictions, targets) -> loss``."""
    if name == "cross_entropy":
        return nn.CrossEntropyLoss()
    if name == "model":
        return None
    loss = plugins.call(plugins.resolve(name, "train.loss"), {}, name, "train.loss")
    if not callable(loss):
        raise ConfigError(f"train.loss={name} returned a {type(loss).__name__}; a loss factory returns a callable.")
    return loss
