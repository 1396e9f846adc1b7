"""What ignite lacks: the collective stop/non-finite guard, the DataParallel loss reduction, the epoch report,
and checkpoint writing that never deletes the previous file before the new one is safely on disk."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, EventEnum, Events
from ignite.handlers import Checkpoint, DiskSaver
from torch import nn

from ignite_mgpu.checkpoint import CheckpointError

logger = logging.getLogger(__name__)

# Set by the launcher in each worker process: the first stop signal received, and the collective timeout
# that replaces the (long) start-up timeout after the first iteration.
_stop_signal = 0
_collective_timeout: float | None = None


def request_stop(signum: int) -> None:
    """Ask every trainer in this process to stop at the next guard check (called from a signal handler)."""
    global _stop_signal
    _stop_signal = _stop_signal or signum


def set_collective_timeout(seconds: float | None) -> None:
    """Collectives after the first iteration wait at most ``seconds`` (None leaves the process group's own)."""
    global _collective_timeout
    _collective_timeout = seconds


class TrainingStopped(RuntimeError):
    """Every rank stopped together on purpose; ``exit_code`` is what the process exits with."""

    exit_code = 1


class TrainingDiverged(TrainingStopped):
    exit_code = 3


class TrainingInterrupted(TrainingStopped):
    def __init__(self, signum: int, iteration: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} at iteration {iteration}; every rank stopped at the same iteration")
        self.exit_code = 128 + signum


class GuardEvents(EventEnum):
    STOPPING = "stopping"  # fired on every rank before a stop on a signal: attach the last checkpoint here


class TrainingGuard:
    """Stops all ranks at the same iteration on a non-finite loss or a stop signal, without a per-step collective.

    One small ``all_gather`` per check shares each rank's stop signal, loss sum and timing. One rank stopping
    alone would leave the others waiting in their next all-reduce, so the decision is collective. The same gather
    yields the loss averaged over ranks: ``engine.state.running_loss`` (since the last check) and
    ``engine.state.metrics["train_loss"]`` (epoch).

    When it checks: every ``every`` iterations; with ``every=0`` about once per ``period`` seconds of training,
    an interval that every rank derives from the same gathered timings (on a tiny model a check every 20 steps
    cost 2-3 % of the step time). Also at each epoch end and on every multiple of ``sync_every`` (give the
    checkpoint interval: nothing is then ever saved after an unchecked NaN). Intervals are multiples of
    ``multiple_of`` (the gradient-accumulation window), so a stop always falls on an optimizer step.
    """

    MAX_INTERVAL = 1000  # iterations: bounds the losses kept between checks on very fast steps

    def __init__(self, every: int = 0, *, period: float = 1.0, sync_every: int = 0, multiple_of: int = 1) -> None:
        if every < 0 or period <= 0 or sync_every < 0 or multiple_of < 1:
            raise ValueError(
                f"TrainingGuard(every={every}, period={period}, sync_every={sync_every}, multiple_of={multiple_of})"
                ": use every >= 0 (0: about every `period` seconds), period > 0, sync_every >= 0, multiple_of >= 1."
            )
        self.every, self.period, self.sync_every, self.multiple_of = every, period, sync_every, multiple_of
        self._next = 0  # iteration of the next scheduled check, set when an epoch starts
        self._since = 0.0  # perf_counter() at the last check or epoch start
        self._losses: list[torch.Tensor] = []
        self._epoch_sum = 0.0
        self._epoch_count = 0.0
        self._timeout_set = False

    def attach(self, engine: Engine) -> None:
        engine.register_events(*GuardEvents)
        engine.state.running_loss = math.nan  # type: ignore[attr-defined]  # shown by the progress bar
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)

    def _started(self, engine: Engine) -> None:  # every run(), also a second one on the same engine
        self._next, self._losses = 0, []

    def _epoch_started(self, engine: Engine) -> None:
        self._epoch_sum, self._epoch_count = 0.0, 0.0
        self._since = time.perf_counter()  # the time between epochs (validation, checkpoints) is not training
        if self._next <= engine.state.iteration:  # a new run, or resumed: the same iteration on every rank
            # Check right after the first step: it shows that every rank is alive and times a step.
            self._next = self._schedule(engine.state.iteration, 1)

    def _schedule(self, iteration: int, interval: int) -> int:
        """The next check after ``iteration``: the next multiple of ``every``, or (auto) about ``interval`` later,
        rounded up to a multiple of ``multiple_of``."""
        if self.every:
            return (iteration // self.every + 1) * self.every
        after = iteration + min(max(interval, 1), self.MAX_INTERVAL)
        return after + -after % self.multiple_of

    def _on_iteration(self, engine: Engine) -> None:
        self._losses.append(engine.state.output)  # type: ignore[arg-type]  # the trainer returns the loss tensor
        if not self._timeout_set:
            self._shorten_timeout()
        iteration = engine.state.iteration
        if iteration >= self._next or (self.sync_every and iteration % self.sync_every == 0):
            self.check(engine)

    def _on_epoch_completed(self, engine: Engine) -> None:
        self.check(engine)
        if self._epoch_count:
            engine.state.metrics["train_loss"] = self._epoch_sum / self._epoch_count

    def _shorten_timeout(self) -> None:
        # The first iteration may be slow (data set building, compilation); after it, a rank that stops
        # answering should fail the job in minutes, not after the process group's 10-30 minute default.
        self._timeout_set = True
        if _collective_timeout is not None and idist.get_world_size() > 1:
            c10d = torch.distributed.distributed_c10d
            set_timeout = getattr(c10d, "set_timeout", None) or c10d._set_pg_timeout  # public only in new torch
            set_timeout(timedelta(seconds=_collective_timeout))

    def check(self, engine: Engine) -> None:
        """Run the collective check now (on every rank at the same iteration). Raises TrainingStopped."""
        if not self._losses:
            return  # every rank has the same iteration count, so all of them skip together
        losses = torch.stack(self._losses).detach().double().cpu()
        self._losses = []
        now = time.perf_counter()
        # A NaN or Inf anywhere makes the float64 sum non-finite: one number carries the non-finite check.
        local = torch.tensor([_stop_signal, float(losses.sum()), len(losses), now - self._since], dtype=torch.float64)
        self._since = now
        rows = (
            torch.as_tensor(idist.all_gather(local)).view(-1, 4).tolist()
            if idist.get_world_size() > 1
            else [local.tolist()]
        )
        if not all(math.isfinite(row[1]) for row in rows):
            self._diverged(engine, losses)
        signum = int(max(row[0] for row in rows))
        if signum:
            engine.fire_event(GuardEvents.STOPPING)
            raise TrainingInterrupted(signum, engine.state.iteration)
        total, count = sum(row[1] for row in rows), sum(row[2] for row in rows)
        engine.state.running_loss = total / count  # type: ignore[attr-defined]
        self._epoch_sum += total
        self._epoch_count += count
        seconds_per_iteration = max(row[3] / row[2] for row in rows)  # the same rows, so the same result everywhere
        self._next = self._schedule(engine.state.iteration, round(self.period / max(seconds_per_iteration, 1e-9)))

    def _diverged(self, engine: Engine, losses: torch.Tensor) -> None:
        """Some rank saw a non-finite loss: find the first such iteration over all ranks (a second gather)."""
        bad = ~torch.isfinite(losses)
        first = engine.state.iteration - len(losses) + 1 + int(bad.int().argmax()) if bad.any() else 0
        local = torch.tensor([first], dtype=torch.float64)
        found = torch.as_tensor(idist.all_gather(local)).tolist() if idist.get_world_size() > 1 else [first]
        iteration, rank = min(((int(it), rank) for rank, it in enumerate(found) if it > 0), default=(0, -1))
        where = f"at iteration {iteration} on rank {rank}" if iteration else "(the loss sum overflowed)"
        raise TrainingDiverged(
            f"non-finite loss (NaN or Inf) {where}; every rank stopped at "
            f"iteration {engine.state.iteration} and nothing was saved after the non-finite loss, so the last "
            "checkpoint is intact. Lower optim.lr, set train.clip_grad_norm, or check the input data."
        )


def reduce_replica_losses(out: torch.Tensor, model: nn.Module, batch_size: int) -> torch.Tensor:
    """The batch loss from a forward that returns the loss itself.

    Under ``nn.DataParallel`` each replica returns the mean loss of its chunk and DataParallel stacks them into
    a vector. The chunks are uneven when the batch does not divide (10 samples on 4 GPUs: 3/3/3/1), so a plain
    mean is wrong: weight each replica's loss by its share of the batch.
    """
    if out.dim() == 0:
        return out
    if isinstance(model, nn.DataParallel) and out.dim() == 1:
        sizes = [len(c) for c in torch.arange(batch_size).chunk(len(model.device_ids))]
        if len(sizes) == out.numel():
            weights = torch.tensor(sizes, dtype=out.dtype, device=out.device) / batch_size
            return (out * weights).sum()
    raise TypeError(
        f"with loss_fn=None the model's forward(x, y) must return the loss as a 0-dim tensor, but it returned "
        f"shape {tuple(out.shape)}. Return loss.mean() from forward, or pass a loss_fn and return the logits."
    )


class LossDataParallel(nn.DataParallel):
    """``nn.DataParallel`` whose replicas may return their own 0-dim loss.

    Plain DataParallel gathers 0-dim outputs with the warning "Was asked to gather along dimension 0, but all
    input tensors were scalars"; here they become a vector quietly, and ``reduce_replica_losses`` weights them.
    """

    def gather(self, outputs: Any, output_device: Any) -> Any:
        if all(isinstance(o, torch.Tensor) and o.dim() == 0 for o in outputs):
            outputs = [o.unsqueeze(0) for o in outputs]
        return super().gather(outputs, output_device)


def _peak_memory_mb(model_devices: list[torch.device]) -> list[float]:
    """Peak memory of each CUDA device this process drives, or of the process itself (RSS) on the CPU."""
    cuda = [d for d in model_devices if d.type == "cuda"]
    if cuda:
        return [torch.cuda.max_memory_allocated(d) / 2**20 for d in cuda]
    import resource

    return [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]  # Linux reports KiB


class EpochReport:
    """After each epoch (and its validation): one JSON line in ``metrics.jsonl`` and a short table on rank 0.

    Fields: epoch, iteration, train_loss (mean over ranks), val_loss, val_accuracy, samples_per_s (global),
    time_per_iter_ms, data_wait_share (time waiting for the data loader / training time, worst rank),
    peak_memory_mb (one entry per GPU, or per process on the CPU) and memory_imbalance (max/min).
    """

    def __init__(self, path: str | Path, global_batch: int, evaluator: Engine, devices: list[torch.device]) -> None:
        self.path, self.global_batch, self.evaluator, self.devices = Path(path), global_batch, evaluator, devices
        self.last: dict[str, Any] = {}
        self._wait = 0.0
        self._fetch_start = 0.0

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        trainer.add_event_handler(Events.GET_BATCH_STARTED, self._fetch_started)
        trainer.add_event_handler(Events.GET_BATCH_COMPLETED, self._fetch_completed)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)

    def _epoch_started(self, engine: Engine) -> None:
        self._wait, self._first_iteration = 0.0, engine.state.iteration
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)

    def _fetch_started(self, engine: Engine) -> None:
        self._fetch_start = time.perf_counter()

    def _fetch_completed(self, engine: Engine) -> None:
        self._wait += time.perf_counter() - self._fetch_start

    def _epoch_completed(self, engine: Engine) -> None:
        seconds = engine.state.times["EPOCH_COMPLETED"] or 1e-9  # training time of this epoch, without handlers
        iterations = engine.state.iteration - self._first_iteration
        local = torch.tensor([self._wait / seconds, *_peak_memory_mb(self.devices)], dtype=torch.float64)
        rows = (
            torch.as_tensor(idist.all_gather(local)).view(idist.get_world_size(), -1).cpu()
            if idist.get_world_size() > 1
            else local[None]
        )
        memory = [round(float(m), 1) for m in rows[:, 1:].flatten()]
        metrics = self.evaluator.state.metrics
        self.last = {
            "epoch": engine.state.epoch,
            "iteration": engine.state.iteration,
            "train_loss": engine.state.metrics.get("train_loss", math.nan),
            "val_loss": metrics.get("loss", math.nan),
            "val_accuracy": metrics.get("accuracy", math.nan),
            "samples_per_s": round(iterations * self.global_batch / seconds, 1),
            "time_per_iter_ms": round(1000 * seconds / max(1, iterations), 3),
            "data_wait_share": round(float(rows[:, 0].max()), 4),
            "peak_memory_mb": memory,
            "memory_imbalance": round(max(memory) / max(min(memory), 1e-9), 3),
            "epoch_time_s": round(seconds, 3),
        }
        if idist.get_rank() == 0:
            with self.path.open("a") as f:
                f.write(json.dumps(self.last) + "\n")
            r = self.last
            world = idist.get_world_size()
            labels = [f"rank {i}" for i in range(world)] if world > 1 else [str(d) for d in self.devices]
            where = "GPU" if self.devices[0].type == "cuda" else "process (RSS)"
            logger.info(
                "epoch %d | train_loss %.4f | val_loss %.4f | val_acc %.4f | %.0f samples/s | %.2f ms/it | "
                "data wait %.0f%%\n  peak memory per %s, MB | %s | max/min %.2f",
                r["epoch"], r["train_loss"], r["val_loss"], r["val_accuracy"], r["samples_per_s"],
                r["time_per_iter_ms"], 100 * r["data_wait_share"], where,
                " | ".join(f"{name}: {mb:.0f}" for name, mb in zip(labels, memory, strict=False)),
                r["memory_imbalance"],
            )  # fmt: skip


class SafeDiskSaver(DiskSaver):
    """DiskSaver that writes a private temp file, fsyncs it, renames it, fsyncs the folder, and only then deletes
    the old checkpoint.

    ignite's Checkpoint asks to remove the oldest file *before* saving the new one (pytorch-ignite #1986): a crash
    or a full disk in between would leave no checkpoint. Removals are deferred until the next save succeeds.
    Files are created 0600 (ignite's DiskSaver adds group/other read bits).
    """

    def __init__(self, dirname: str | Path) -> None:
        super().__init__(dirname, atomic=True, create_dir=True, require_empty=False)
        self._pending: list[str] = []

    def _save_func(self, checkpoint: Mapping, path: Path, func: Callable) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dirname, prefix=".tmp-", suffix=".pt")
        try:
            with os.fdopen(fd, "wb") as f:
                func(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            Path(tmp).unlink(missing_ok=True)
            kept = ", ".join(sorted(p.name for p in Path(self.dirname).glob("checkpoint_*.pt"))) or "none"
            raise CheckpointError(f"saving {path.name} failed ({err}); kept the previous checkpoints: {kept}") from err
        _fsync_dir(self.dirname)  # the rename survives a power loss only once its folder is synced
        for name in self._pending:
            if name != path.name:  # ignite "removes" a file it is about to overwrite under the same name
                (Path(self.dirname) / name).unlink(missing_ok=True)
        self._pending.clear()

    def remove(self, filename: str) -> None:
        if idist.get_rank() == self.save_on_rank:
            self._pending.append(filename)


def _fsync_dir(folder: str | Path) -> None:
    """Best effort: some network and virtual file systems refuse to fsync a folder (the file is in place anyway)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        logger.debug("fsync of folder %s failed: %s", folder, err)


def create_checkpointers(
    objects: Mapping[str, Any],
    model: nn.Module,
    dirname: str | Path,
    n_saved: int,
    metric: str,
    best_step: Callable[[Any, Any], int],
) -> tuple[Checkpoint, Checkpoint]:
    """(full training state ``checkpoint_<iteration>.pt``, best unwrapped model ``best_model_*.pt``)."""
    saver = SafeDiskSaver(dirname)
    full = Checkpoint(dict(objects), saver, n_saved=n_saved, global_step_transform=lambda e, _: e.state.iteration)
    sign = 1.0 if metric == "accuracy" else -1.0
    best = Checkpoint(
        {"model": model},
        saver,
        filename_prefix="best",
        n_saved=1,
        score_function=lambda e: sign * e.state.metrics[metric],
        score_name=f"val_{metric}",
        global_step_transform=best_step,
    )
    return full, best
