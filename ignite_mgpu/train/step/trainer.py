"""The trainer: ``create_trainer`` returns an ignite Engine for your own code, one training step with switches
(precision, accumulation, clipping) for every strategy, its parts in ``trainer.step``. The loss is ``losses.py``'s
(``create_loss``, also importable from here), the evaluator ``evaluator.py``'s."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from torch import nn

from ignite_mgpu.config.schema import PRECISIONS
from ignite_mgpu.parallel.strategy import no_sync, reduce_replica_losses, unwrap
from ignite_mgpu.train.data import batches
from ignite_mgpu.train.data.batches import Batch
from ignite_mgpu.train.data.sampler import GlobalBatchSampler

# Its home before losses.py: still importable here.
from ignite_mgpu.train.losses import create_loss as create_loss
from ignite_mgpu.train.step.core import Step, optimizer_step
from ignite_mgpu.train.step.deterministic import PortableDeterministicEngine, use_deterministic_algorithms
from ignite_mgpu.train.step.guard import TrainingGuard, accumulation_window
from ignite_mgpu.train.step.micro_batch import MicroBatching
from ignite_mgpu.train.step.micro_step import micro_batch_step
from ignite_mgpu.train.step.timing import StepTimes, watch_gradient_sync

logger = logging.getLogger(__name__)

# Fp16 needs a GradScaler, which PyTorch ships for CUDA; bf16 is the CPU's choice.
FP16_DEVICE_TYPES = ("cuda",)


class Scaler(torch.amp.GradScaler):
    """GradScaler that keeps its initial state when the checkpoint holds none: a run saved in fp32 (a disabled
    scaler saves ``{}``) may resume in fp16 (``checkpoint.allow_config_change``), where GradScaler would raise."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict or not self.is_enabled():
            super().load_state_dict(state_dict)


def under_autocast(forward: Callable[..., Any], precision: str, device: torch.device) -> Callable[..., Any]:
    """``forward`` run under autocast for bf16/fp16; for fp32 ``forward`` itself, so no context is entered."""
    if precision == "fp32":
        return forward
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    # An autocast also decorates.
    return torch.autocast(device_type=device.type, dtype=dtype)(forward)


class Trainer(Engine):
    """``create_trainer``'s Engine: ignite's own, with what its step is made of in ``step`` (a ``Step``)."""

    step: Step


class DeterministicTrainer(PortableDeterministicEngine, Trainer):
    """``create_trainer(deterministic=True)``'s Engine: ignite's ``DeterministicEngine``, portable checkpoints."""


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
    checkpoint_every_iters: int = 0,
    checkpoint_every_minutes: float | None = None,
    non_blocking: bool = True,
    micro_batch: int | str | None = None,
    micro_batch_file: str | Path | None = None,
) -> Trainer:
    """A trainer Engine for a model already placed by ``prepare_model`` (DDP, DataParallel, FSDP or plain).

    Each iteration: the batch to the device, forward under autocast, backward (DDP's ``no_sync`` or FSDP's sync off
    on accumulation steps), then unscale, clip (the global norm), optimizer and scheduler step. Batches and outputs
    take the forms of ``batches.py``; with ``loss_fn=None`` the model computes its own loss. ``engine.state.output``
    is the detached loss; a ``TrainingGuard`` stops every rank together on a non-finite loss or a stop signal.
    ``trainer.step`` holds the step's parts: ``trainer.step.scaler`` is fp16's GradScaler (save and restore it with
    your checkpoints), ``trainer.step.micro_batching`` the micro-batch size (``micro_batch``).

    Args:
        precision: "fp32", "bf16" (autocast on CUDA and CPU) or "fp16" (CUDA only, with a GradScaler).
        grad_accum_steps: micro-batches per optimizer step. Windows restart every epoch; an epoch's short last
            window divides its loss by its own length, so every step's gradient is the mean over its window.
        deterministic: ignite's DeterministicEngine (exact mid-epoch resume) and PyTorch's strict deterministic mode,
            with ``CUBLAS_WORKSPACE_CONFIG`` set unless you set it.
        check_every: iterations between the guard's collective checks, rounded to ``grad_accum_steps``; 0: about
            once a second, an interval the ranks agree on from their measured step times.
        checkpoint_every_iters: your checkpoint handler's iteration interval (``checkpoint.every_iters``): the guard
            checks there too, so nothing is saved after an unchecked non-finite loss.
        checkpoint_every_minutes: also fire ``GuardEvents.CHECKPOINT`` about this often (the ranks agree at a
            check); it fires for ``checkpoint_every_iters`` too, at the end of the window holding the multiple.
    """
    device = torch.device(device) if device is not None else idist.device()
    _check_step_options(precision, grad_accum_steps, device)
    if deterministic:
        use_deterministic_algorithms()
    step = Step(
        model=model, optimizer=optimizer, loss_fn=loss_fn, precision=precision, device=device,
        # backward runs outside the autocast
        compute_loss=under_autocast(_loss_of_batch(model, loss_fn), precision, device),
        scaler=Scaler(device.type, enabled=precision == "fp16"), non_blocking=non_blocking,
        grad_accum_steps=grad_accum_steps, clip_grad_norm=clip_grad_norm, lr_scheduler=lr_scheduler,
        parameters=tuple(p for p in model.parameters() if p.requires_grad), no_sync=no_sync(model),
        micro_batching=MicroBatching(micro_batch, micro_batch_file) if micro_batch is not None else None,
        times=StepTimes(device),
    )  # fmt: skip
    return _engine(step, deterministic, check_every, checkpoint_every_iters, checkpoint_every_minutes)


def _engine(
    step: Step, deterministic: bool, check_every: int, every_iters: int, every_minutes: float | None
) -> Trainer:
    """The Engine around the step (this module's, or ``micro_step.py``'s in parts), the sampler's epochs, the guard."""
    process = _train_step(step) if step.micro_batching is None else micro_batch_step(step)
    trainer = DeterministicTrainer(process) if deterministic else Trainer(process)
    trainer.step = step
    # Failures are reported once by the launcher, not by every rank's engine.
    trainer.logger.setLevel("CRITICAL")
    trainer.add_event_handler(Events.EPOCH_STARTED, _set_sampler_epoch)
    # At the start of run(), not here: a comm hook the user registers after create_trainer comes first (DDP takes one).
    trainer.add_event_handler(Events.STARTED, watch_gradient_sync, step.model, step.times, idist.get_world_size())
    _attach_guard(trainer, check_every, step.grad_accum_steps, every_iters, every_minutes)
    return trainer


def _attach_guard(
    trainer: Engine, check_every: int, grad_accum_steps: int, every_iters: int, every_minutes: float | None
) -> None:
    # A stop must fall on an optimizer step, never inside a gradient-accumulation window.
    if check_every:
        check_every = max(grad_accum_steps, check_every // grad_accum_steps * grad_accum_steps)
    guard = TrainingGuard(
        check_every,
        checkpoint_every_iters=every_iters,
        grad_accum_steps=grad_accum_steps,
        checkpoint_every_minutes=every_minutes,
    )
    guard.attach(trainer)


def _check_step_options(precision: str, grad_accum_steps: int, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {PRECISIONS}.")
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps}: use 1 (no accumulation) or more.")
    if precision == "fp16" and device.type not in FP16_DEVICE_TYPES:
        raise ValueError("precision='fp16' needs CUDA (a GradScaler); on the CPU use precision='bf16'.")


def _loss_of_batch(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None) -> Callable[[Batch], torch.Tensor]:
    """The loss of one batch: ``loss_fn`` over the model's output, or the loss the model computes itself."""

    def compute_loss(batch: Batch) -> torch.Tensor:
        # The model computes its own loss; DataParallel returns one per GPU: weigh them exactly.
        if loss_fn is None:
            out = batches.loss_of(batches.model_loss(model, batch))
            return reduce_replica_losses(out, model, batches.size(batch))
        # The Mapping ABC check is slower.
        if not isinstance(batch, (list, tuple)) and isinstance(batch, Mapping):
            inputs, targets = batches.split(batch)
            return loss_fn(batches.logits(model(**inputs)), targets)
        out = model(batch[0])
        return loss_fn(out if isinstance(out, torch.Tensor) else batches.logits(out), batch[1])

    return compute_loss


def _train_step(step: Step) -> Callable[[Engine, Batch], torch.Tensor]:
    """The Engine's process function: one micro-batch forward and backward, and on a window's last one the step."""
    # The parts as the closure's own variables: train_step reads no attribute of ``step`` per iteration.
    model, compute_loss, scaler, no_sync = step.model, step.compute_loss, step.scaler, step.no_sync
    device, non_blocking, grad_accum_steps = step.device, step.non_blocking, step.grad_accum_steps
    fp16, shares = scaler.is_enabled(), step.shares
    finish = optimizer_step(step)
    # Where the step goes: the clock read at its start, after backward, after the optimizer step (timing.py).
    clock, add = step.times.clock, step.times.add
    inner = unwrap(model)  # the evaluator switches the unwrapped module to eval mode
    # A CPU job's batches are in CPU memory already: no per-step walk to find that out.
    move = device.type != "cpu"

    def forward_backward(batch: Batch, window: int, iteration: int) -> torch.Tensor:
        loss = compute_loss(batch)
        if shares.weights is not None:
            loss = loss * shares.weight(iteration)
        # The window's gradient is the mean over its micro-batches.
        scaled = loss / window if window > 1 else loss
        (scaler.scale(scaled) if fp16 else scaled).backward()
        return loss

    # Every line in here runs once per iteration (benchmarks/ counts what they cost in instructions): the fp32 path
    # enters no context and skips the disabled scaler, and without accumulation the backward is inline.
    def train_step(engine: Engine, batch: Batch) -> torch.Tensor:
        # model.train() walks every submodule: only do it after an evaluation.
        if not inner.training:
            model.train()
        start = clock()
        if move:
            batch = batches.to_device(batch, device, non_blocking)
        if grad_accum_steps == 1:
            loss = compute_loss(batch)
            # Uneven shares: this rank's mean counts by its share, so that DDP's average is the global batch's mean.
            if shares.weights is not None:
                loss = loss * shares.weight(engine.state.iteration)
            (scaler.scale(loss) if fp16 else loss).backward()
        else:
            # Windows restart every epoch: an epoch-end checkpoint or stop never holds half a window's gradients.
            last, window = accumulation_window(engine.state.iteration, engine.state.epoch_length, grad_accum_steps)
            if not last:
                # An accumulation step: gradients stay local until the last micro-batch.
                with no_sync():
                    loss = forward_backward(batch, window, engine.state.iteration)
                add(start, clock())
                return loss.detach()
            loss = forward_backward(batch, window, engine.state.iteration)
        backward_end = clock()
        finish()
        add(start, backward_end, clock())
        return loss.detach()

    return train_step


def _set_sampler_epoch(engine: Engine) -> None:
    # A DistributedSampler shuffles with seed + epoch; without set_epoch every epoch repeats the same order.
    loader = engine.state.dataloader
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None) or getattr(loader, "sampler", None)
    set_epoch = getattr(sampler, "set_epoch", None)
    if set_epoch is not None:
        set_epoch(engine.state.epoch - 1)
    # A dataset whose per-sample randomness follows the epoch (the built-in image folder's augmentation).
    dataset_epoch = getattr(getattr(loader, "dataset", None), "set_epoch", None)
    if dataset_epoch is not None:
        dataset_epoch(engine.state.epoch - 1)
    if isinstance(sampler, GlobalBatchSampler) and isinstance(engine, Trainer):
        _follow_global_batches(engine, sampler)


def _follow_global_batches(trainer: Trainer, sampler: GlobalBatchSampler) -> None:
    """A resumed epoch goes on from its position in the epoch's global batches (on any process count: the same
    samples); the step weights this rank's loss by its share when the shares of the global batch are uneven, and
    the step in parts reads the largest share."""
    state = trainer.state
    position = state.iteration % state.epoch_length if state.epoch_length else 0
    # The DeterministicEngine skips the resumed epoch's first batches itself.
    if position and not isinstance(trainer, DeterministicTrainer):
        if state.epoch_length == sampler.batches:
            sampler.set_start(position)
        elif idist.get_rank() == 0:
            logger.warning(
                "resumed at iteration %d of an epoch of %d iterations (as the checkpoint counts it: "
                "train.epoch_length, or the data's batches when it was written), not the data's %d global batches "
                "now: the rest of this epoch comes from a new pass over the data, so some of its samples may repeat. "
                "Leave train.epoch_length unset, and the data as it was, for a resume that continues at the exact "
                "sample.",
                position,
                state.epoch_length,
                sampler.batches,
            )
    trainer.step.shares.weights = None if sampler.even else sampler.weights()
    trainer.step.shares.largest = sampler.largest()
