"""The epoch log: after each epoch (and its validation) one JSON line in ``metrics.jsonl`` and a short table on rank 0
(losses, accuracy, throughput, data-wait share, peak memory per GPU or process, each rank's step split), what
``ignite-mgpu report`` reads back (``runs/``); the experiment trackers log the same numbers (``trackers.py``)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from ignite_mgpu.runs.bottleneck import Split, Verdict, judge, slowest_rank
from ignite_mgpu.train.goodput import Goodput
from ignite_mgpu.train.step.trainer import Trainer

logger = logging.getLogger(__name__)


def _peak_memory_mb(model_devices: list[torch.device]) -> list[float]:
    """Peak memory of each CUDA device this process drives, or of the process itself (RSS) on the CPU."""
    cuda = [d for d in model_devices if d.type == "cuda"]
    if cuda:
        return [torch.cuda.max_memory_allocated(d) / 2**20 for d in cuda]
    import resource

    return [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]  # Linux reports KiB


# The log line's own columns; other validation metrics follow them.
SHOWN = ("val_loss", "val_accuracy")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def jsonable(value: Any) -> Any:
    """A metric's value for JSON: a number as it is, a tensor as a number or a list; None for anything else (a
    mapping's entries are metrics of their own: ignite puts them beside it)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value if _is_number(value) or isinstance(value, list) else None


def validation_fields(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The epoch log's validation fields: ``val_loss`` (NaN without one), then ``val_<name>`` of every other
    metric the evaluator reports, in its order (``val_accuracy`` for the default classification metrics)."""
    fields = {"val_loss": metrics.get("loss", math.nan)}
    for name, value in metrics.items():
        if name != "loss" and (found := jsonable(value)) is not None:
            fields[f"val_{name}"] = found
    return fields


class EpochLog:
    """After each epoch (and its validation): one JSON line in ``metrics.jsonl`` and a short table on rank 0.

    Fields: epoch, iteration, train_loss (mean over the epoch's samples), val_loss, val_accuracy (classification
    only; with eval.metrics, val_<name> of each metric), samples_per_s (global), time_per_iter_ms, data_wait_share (time
    waiting for the data loader / training time, worst rank),
    peak_memory_mb (one entry per GPU, or per process on the CPU), peak_memory_per ("gpu": CUDA's peak allocated
    memory of each GPU; "process": each process's peak RSS), memory_imbalance (max/min) and restarts (how often
    the job had been restarted when it trained the epoch); with ``create_trainer``'s engine, where each rank's step
    went (time_data_ms, time_compute_ms, time_comm_ms, time_optimizer_ms: per rank, ms per iteration), slowest_rank
    and bound_by (``runs/bottleneck.py``); ``verdict()`` judges every epoch of the run so far.
    """

    def __init__(
        self,
        path: str | Path,
        global_batch: int,
        evaluator: Engine | None,
        devices: list[torch.device],
        restarts: int = 0,
        goodput: Goodput | None = None,
    ) -> None:
        self.path, self.global_batch, self.evaluator, self.devices = Path(path), global_batch, evaluator, devices
        self.restarts, self.goodput = restarts, goodput
        self.last: dict[str, Any] = {}
        self._wait = 0.0
        self._fetch_start = 0.0
        # (loader, its wait_seconds) when the epoch started.
        self._timed: tuple[Any, float] | None = None
        self._timer_attached = False
        # The run's split so far in this process: per rank, seconds of data, compute, comm, optimizer; then the
        # training seconds and iterations (the verdict at the run's end).
        self._run: tuple[torch.Tensor, float, int] | None = None
        self._sharded = False  # the trainer's communication is FSDP's all-gathers

    def memory_tags(self) -> list[str]:
        """The trackers' names of the same entries: ``memory/rank<k>`` for processes, ``memory/gpu<k>`` for the GPUs
        of one process (k: its CUDA index in the job)."""
        world, cuda = idist.get_world_size(), [d for d in self.devices if d.type == "cuda"]
        if world == 1 and cuda:
            return [f"memory/gpu{k}" for k in range(len(cuda))]
        return [f"memory/rank{k}" for k in range(world)]

    def drop_epochs_after(self, epoch: int) -> None:
        """Resuming after ``epoch`` finished epochs: drop the lines of later epochs (and a half-written one) that
        the interrupted run wrote after its checkpoint, so that every epoch is recorded once. Atomic."""
        if not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                if json.loads(line)["epoch"] <= epoch and line.endswith("\n"):
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.path)

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.STARTED, self._started)
        trainer.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)

    def _started(self, engine: Engine) -> None:
        # The data wait: a TimedDataLoader (the default job's) counts it; any other loader is timed by two handlers
        # per iteration, around ignite's fetch of the batch.
        if not hasattr(engine.state.dataloader, "wait_seconds") and not self._timer_attached:
            self._timer_attached = True
            engine.add_event_handler(Events.GET_BATCH_STARTED, self._fetch_started)
            engine.add_event_handler(Events.GET_BATCH_COMPLETED, self._fetch_completed)

    def _epoch_started(self, engine: Engine) -> None:
        self._wait, self._first_iteration = 0.0, engine.state.iteration
        loader: Any = engine.state.dataloader
        self._timed = (loader, loader.wait_seconds) if hasattr(loader, "wait_seconds") else None
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)
        if isinstance(engine, Trainer):
            engine.step.times.reset()

    # No engine argument: ignite then calls it without resolving a weak reference.
    def _fetch_started(self) -> None:
        self._fetch_start = time.perf_counter()

    def _fetch_completed(self) -> None:
        self._wait += time.perf_counter() - self._fetch_start

    def _epoch_wait(self, engine: Engine) -> float:
        """Seconds this epoch waited for its batches."""
        if self._timed is None:
            return self._wait
        loader, before = self._timed
        # ignite's DeterministicEngine replaces the loader once, after the first epoch started: a new count from 0.
        now: Any = engine.state.dataloader  # a TimedDataLoader, as when the epoch started
        return now.wait_seconds - (before if now is loader else 0.0)

    def _epoch_completed(self, engine: Engine) -> None:
        # Training time of this epoch, without handlers.
        seconds = engine.state.times["EPOCH_COMPLETED"] or 1e-9
        iterations = engine.state.iteration - self._first_iteration
        wait = self._epoch_wait(engine)
        split = engine.step.times.seconds() if isinstance(engine, Trainer) else (math.nan,) * 3
        # One gather per epoch carries every rank's numbers: no collective per iteration.
        local = torch.tensor([wait / seconds, wait, *split, *_peak_memory_mb(self.devices)], dtype=torch.float64)
        rows = (
            torch.as_tensor(idist.all_gather(local)).view(idist.get_world_size(), -1).cpu()
            if idist.get_world_size() > 1
            else local[None]
        )
        memory = [round(float(m), 1) for m in rows[:, 5:].flatten()]
        metrics = self.evaluator.state.metrics if self.evaluator is not None else {}  # None: no validation
        self.last = {
            "epoch": engine.state.epoch,
            "iteration": engine.state.iteration,
            "train_loss": engine.state.metrics.get("train_loss", math.nan),
            # val_loss, then val_<name> of every other metric (eval.metrics)
            **validation_fields(metrics),
            "samples_per_s": round(iterations * self.global_batch / seconds, 1),
            "time_per_iter_ms": round(1000 * seconds / max(1, iterations), 3),
            "data_wait_share": round(float(rows[:, 0].max()), 4),
            "peak_memory_mb": memory,
            "peak_memory_per": "gpu" if self.devices[0].type == "cuda" else "process",
            "memory_imbalance": round(max(memory) / max(min(memory), 1e-9), 3),
            "epoch_time_s": round(seconds, 3),
            "restarts": self.restarts,
            "processes": idist.get_world_size(),  # an elastic job's changes with the GPUs it runs on
        }
        if isinstance(engine, Trainer):
            self._sharded = engine.step.times.sharded
            self.last |= self._split_fields(rows[:, 1:5], seconds, iterations)
        if self.goodput is not None:
            self.last |= self.goodput.line(float(rows[:, 1].max()), engine.state.iteration)
        # train.micro_batch: the part size at the epoch's end.
        sizing = engine.step.micro_batching if isinstance(engine, Trainer) else None
        if sizing is not None:
            whole = self.global_batch // idist.get_world_size() if idist.backend() else self.global_batch
            self.last["micro_batch"] = sizing.size if sizing.size is not None else whole
        if idist.get_rank() == 0:
            with self.path.open("a") as f:
                f.write(json.dumps(self.last) + "\n")
            r = self.last
            world = idist.get_world_size()
            labels = [f"rank {i}" for i in range(world)] if world > 1 else [str(d) for d in self.devices]
            where = "GPU" if self.devices[0].type == "cuda" else "process (RSS)"
            accuracy = f" | val_acc {r['val_accuracy']:.4f}" if "val_accuracy" in r else ""
            others = "".join(
                f" | {k} {v:.4f}" for k, v in r.items() if k.startswith("val_") and k not in SHOWN and _is_number(v)
            )
            logger.info(
                "epoch %d | train_loss %.4f | val_loss %.4f%s | %.0f samples/s | %.2f ms/it | "
                "data wait %.0f%%\n  peak memory per %s, MB | %s | max/min %.2f",
                r["epoch"], r["train_loss"], r["val_loss"], accuracy + others, r["samples_per_s"],
                r["time_per_iter_ms"], 100 * r["data_wait_share"], where,
                " | ".join(f"{name}: {mb:.0f}" for name, mb in zip(labels, memory, strict=False)),
                r["memory_imbalance"],
            )  # fmt: skip

    def _split_fields(self, parts: torch.Tensor, seconds: float, iterations: int) -> dict[str, Any]:
        """The epoch's step split per rank (milliseconds per iteration) and its verdict; the run's sums go on."""
        if self._run is None or self._run[0].shape != parts.shape:
            self._run = (torch.zeros_like(parts), 0.0, 0)
        run, run_seconds, run_iterations = self._run
        self._run = (run + parts, run_seconds + seconds, run_iterations + iterations)
        split = _split(parts, seconds, iterations, self._sharded)
        verdict = judge(split, self.devices[0].type)
        return {
            "time_data_ms": split.data,
            "time_compute_ms": split.compute,
            "time_comm_ms": [None if math.isnan(c) else c for c in split.comm],
            "time_optimizer_ms": split.optimizer,
            "slowest_rank": slowest_rank(split),
            "bound_by": verdict.bound_by,
        }

    def verdict(self) -> Verdict | None:
        """Where the run's step time went, judged over every epoch this process trained (None before one)."""
        if self._run is None or not self._run[2]:
            return None
        return judge(_split(*self._run, self._sharded), self.devices[0].type)


def _split(parts: torch.Tensor, seconds: float, iterations: int, sharded: bool = False) -> Split:
    """Each rank's seconds (data, compute, comm, optimizer) as milliseconds per iteration."""
    per = 1000 / max(1, iterations)
    data, compute, comm, optimizer = ([round(float(v) * per, 3) for v in parts[:, k]] for k in range(4))
    return Split(data, compute, comm, optimizer, step_ms=seconds * per, sharded=sharded)
