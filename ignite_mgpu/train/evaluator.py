"""The evaluator: ``create_evaluator`` scores a prepared model with metrics reduced over all ranks; every sample of
the validation split counts once, also when the shards are uneven, and an FSDP model runs as many forwards on every
rank, also in parts; ``validation_metrics`` are the metrics the default job reports (``eval.metrics``:
``metrics.py``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.metrics import Accuracy, Loss, Metric
from torch import nn

from ignite_mgpu.env import stop
from ignite_mgpu.parallel.fsdp import find_fsdp
from ignite_mgpu.parallel.strategy import find_ddp, reduce_replica_losses
from ignite_mgpu.train.data import batches
from ignite_mgpu.train.data.batches import Batch
from ignite_mgpu.train.data.loaders import most_batches
from ignite_mgpu.train.metrics import create_metrics
from ignite_mgpu.train.step.micro_batch import MicroBatching, in_parts
from ignite_mgpu.train.step.trainer import under_autocast


def create_evaluator(
    model: nn.Module,
    metrics: Mapping[str, Metric],
    *,
    model_loss: bool = False,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    non_blocking: bool = True,
    micro_batch: int | MicroBatching | None = None,
) -> Engine:
    """An evaluator Engine whose metrics are reduced over all ranks (ignite metrics all-reduce in ``compute``).

    Each batch's output is ``(predictions, targets)`` for the metrics; with ``model_loss=True`` (the model computes
    its own loss, as ``create_trainer(loss_fn=None)``) it is ``(loss, batch size)``, for ``validation_metrics(None)``.
    It runs the unwrapped module: DDP's forward may broadcast buffers, a collective that would hang when ranks
    hold different numbers of validation batches (the validation sampler does not pad). An FSDP model's every
    forward is a collective: ranks with fewer batches repeat their last one, unscored, until all ran as many.
    ``micro_batch`` (a size, or the trainer's ``trainer.step.micro_batching``): each batch in parts of that many
    samples, the outputs joined (a loss weighted by the parts' samples); under FSDP the ranks agree on each batch's
    largest share and every rank runs as many parts.
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

    forward = under_autocast(output, precision if precision != "fp16" or device.type == "cuda" else "fp32", device)
    fsdp = find_fsdp(model) is not None and idist.get_world_size() > 1
    if micro_batch is not None:
        # FSDP: as many forwards on every rank, so as many parts as the largest share of the batch makes.
        forward = in_parts(forward, micro_batch, model_loss, _most_samples if fsdp else None)

    @torch.no_grad()
    def eval_step(engine: Engine, batch: Batch) -> tuple[torch.Tensor, Any]:
        return forward(batches.to_device(batch, device, non_blocking))

    evaluator = Engine(eval_step)
    # Once per run: eval() visits every submodule.
    evaluator.add_event_handler(Events.STARTED, lambda: net.eval())
    # A sign of life for the supervisor's hang watch: a long evaluation is progress, not a hang.
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, stop.note_activity)
    evaluator.logger.setLevel("CRITICAL")
    if fsdp:  # its forward is a collective: as many on every rank, before the metrics reduce
        attach_even_forwards(evaluator, eval_step)
    for name, metric in metrics.items():
        metric.attach(evaluator, name)
    reduce_together(evaluator, metrics)
    return evaluator


def _most_samples(n: int) -> int:
    """The most samples any rank holds of the batch it evaluates now (a collective: every rank is at that batch)."""
    return int(idist.all_reduce(torch.tensor(n, device=idist.device()), op="MAX"))


# The states that ignite's Loss and Accuracy all-reduce in ``compute``, one collective per state.
JOINTLY_REDUCED: dict[type, tuple[str, ...]] = {
    Loss: ("_sum", "_num_examples"),
    Accuracy: ("_num_correct", "_num_examples"),
}


def reduce_together(evaluator: Engine, metrics: Mapping[str, Metric]) -> None:
    """On several processes, when every metric is a ``Loss`` or an ``Accuracy`` (exactly these classes: the default
    job's), all-reduce all their states in one collective at the end of the run, instead of one per state (4 for
    loss and accuracy, 2 for a loss alone): each is a round trip between all ranks, and a host sync on GPUs
    (``benchmarks/fsdp/bench_fsdp_step.py``). Their values are ignite's: each metric's own ``compute`` runs on the
    reduced states, which are put back afterwards, as ignite's ``sync_all_reduce`` does. Any other set of metrics
    reduces itself, one collective per state, as before."""
    joint = {n: m for n, m in metrics.items() if _reducible(m)}
    # All of them: the same key order.
    if idist.get_world_size() == 1 or not joint or len(joint) < len(metrics):
        return
    for metric in joint.values():
        evaluator.remove_event_handler(metric.completed, Events.EPOCH_COMPLETED)
    states = [(m, attr) for m in joint.values() for attr in JOINTLY_REDUCED[type(m)]]

    def completed(engine: Engine) -> None:
        local = [getattr(m, attr) for m, attr in states]
        flat = torch.stack([torch.as_tensor(v, device=idist.device()).to(torch.float64).reshape(()) for v in local])
        reduced = cast(torch.Tensor, idist.all_reduce(flat))
        for (m, attr), old, value in zip(states, local, reduced, strict=True):
            setattr(m, attr, value.to(old.dtype) if isinstance(old, torch.Tensor) else type(old)(value.item()))
        try:
            for name, m in joint.items():
                # Undecorated: no all-reduce.
                engine.state.metrics[name] = inspect.unwrap(type(m).compute)(m)
        finally:
            for (m, attr), old in zip(states, local, strict=True):
                setattr(m, attr, old)

    evaluator.add_event_handler(Events.EPOCH_COMPLETED, completed)


def _reducible(metric: Metric) -> bool:
    """Whether ``metric`` is one whose states ``reduce_together`` knows: the class and ignite's state names (kept
    across ignite's releases so far; another release that renames them falls back to ignite's own reduction). The
    states are looked up in the instance: a Metric answers any other attribute with a MetricsLambda factory."""
    names = JOINTLY_REDUCED.get(type(metric))
    return names is not None and hasattr(type(metric).compute, "__wrapped__") and all(n in vars(metric) for n in names)


def attach_even_forwards(evaluator: Engine, step: Callable[[Engine, Any], Any]) -> None:
    """Make every rank run as many forwards as the rank with the most validation batches.

    Each FSDP forward all-gathers parameters, a collective, and the validation shards are uneven (every sample is
    counted once), so a rank with fewer batches would leave the others waiting forever. Every rank knows the most
    batches when the evaluation starts: computed for the validation sampler (``loaders.most_batches``), else agreed
    in a collective then, while every rank is there. After its own batches a rank repeats ``step`` on its last
    batch as often as it is short. The outputs are dropped, so the metrics never see them. Attach it before the
    metrics: their EPOCH_COMPLETED handlers all-reduce, after these forwards.
    """
    start, most = [0], [0]

    def started(engine: Engine) -> None:
        start[0] = engine.state.iteration
        known = most_batches(engine.state.dataloader, engine.state.epoch_length)
        if known is None:  # a loader of the user's: ask every rank
            mine = torch.tensor(engine.state.epoch_length or 0, device=idist.device())
            known = int(idist.all_reduce(mine, op="MAX"))
        most[0] = known

    def pad(engine: Engine) -> None:
        for _ in range(most[0] - (engine.state.iteration - start[0])):
            step(engine, engine.state.batch)

    evaluator.add_event_handler(Events.EPOCH_STARTED, started)
    evaluator.add_event_handler(Events.EPOCH_COMPLETED, pad)


def validation_metrics(
    loss_fn: Callable[..., torch.Tensor] | None,
    device: torch.device,
    names: Sequence[str] | None = None,
    args: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Metric]:
    """Metrics for ``create_evaluator``, accumulated on ``device`` (ignite keeps them on the CPU by default: a copy to
    the host per validation batch on a GPU): the loss, weighted by the samples of every batch (exact over uneven
    shards), for any loss function or for a model that computes its own (``loss_fn=None``; pair it with
    ``create_evaluator(model_loss=True)``); then accuracy for cross-entropy, or with ``names`` (``eval.metrics``:
    accuracy, top5, f1, perplexity, ``package.module:factory``, ...) those, ``args`` by name
    (``eval.metric_args``)."""
    # Outputs are (mean loss of the batch, its size): the metric sums loss x size over ranks.
    if loss_fn is None:
        metrics: dict[str, Metric] = {"loss": Loss(lambda loss, n: loss, batch_size=lambda n: n, device=device)}
    else:
        metrics = {"loss": Loss(loss_fn, device=device)}
    if names is not None:
        return metrics | create_metrics(names, loss_fn is None, device, args or {})
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        metrics["accuracy"] = Accuracy(device=device)
    return metrics
