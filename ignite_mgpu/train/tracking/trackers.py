"""The experiment trackers of ``train.loggers`` on rank 0 (each one's own code: ``backends.py``): what they
log and when, through ignite's ``OutputHandler``s. A tracker that fails to start or to log is a warning, once,
and training goes on without it; none can end the training.

What every tracker gets, under the same names:
- ``train/loss`` (rank 0's loss of that iteration) and ``train/lr`` (``train/lr/<k>`` with several parameter
  groups) every ``train.log_every`` iterations, at step = the iteration;
- ``val/<name>`` for every metric of the evaluator, after each validation;
- the epoch log's numbers, as metrics.jsonl names them (``train_loss``, ``samples_per_s``, ``data_wait_share``,
  ``memory/rank<k>``, each rank's step split ``time_compute_ms/rank<k>``, ...), after each epoch; these and the
  validation metrics at step = the epoch (W&B: at the iteration, with ``epoch`` beside them);
- at each start, the resolved config and the run's facts (``run_facts.py``: GPUs, processes, restarts, version).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from ignite_mgpu.config.schema import Config, trackers_of
from ignite_mgpu.errors import TrainingInterrupted
from ignite_mgpu.runs import folder
from ignite_mgpu.train.epoch_log import EpochLog
from ignite_mgpu.train.tracking.backends import Backend, Csv, TensorBoard, WandB
from ignite_mgpu.train.tracking.mlflow_tracker import MLflow
from ignite_mgpu.train.tracking.run_facts import flat_config, job_gpus, run_facts

logger = logging.getLogger("ignite_mgpu")

# Each built from (its logger_args, the run folder, the trainer, what a resumed run remembered, the flat config).
BACKENDS: dict[str, Callable[..., Backend]] = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB, "csv": Csv}


def _reason(err: BaseException) -> str:
    """The first line of an exception, short enough for one warning."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:300]}" if first else type(err).__name__


class Tracker:
    """One started tracker: every call into it is guarded; the first exception disables it with one warning."""

    def __init__(self, backend: Backend) -> None:
        self.backend, self.alive = backend, True

    def call(self, what: str, fn: Any, *args: Any) -> None:
        if not self.alive:
            return
        try:
            fn(*args)
        except Exception as err:  # anything a tracker raises: its server, its files, its own bugs
            self.alive = False
            logger.warning(
                "train.loggers: the %s tracker failed %s (%s); training goes on without it.",
                self.backend.name, what, _reason(err),
            )  # fmt: skip
            with contextlib.suppress(Exception):
                self.backend.abandon()

    def guarded(self, handler: Any) -> Any:
        """``handler`` (an ignite log handler: engine, logger, event) called through ``call``."""

        def log(engine: Engine, tracker_logger: Any, event_name: Any) -> None:
            self.call("to log", handler, engine, tracker_logger, event_name)

        return log


# The step's split as each rank's own number: time_compute_ms/rank1 (None where not measured: left out).
SPLIT_FIELDS = ("time_data_ms", "time_compute_ms", "time_comm_ms", "time_optimizer_ms")


def epoch_numbers(epoch_log: EpochLog) -> dict[str, float]:
    """The numbers of the epoch log's last row, the peak memory of each rank (or GPU) and each rank's step split
    (``time_compute_ms/rank<k>``, ...) as one number each."""
    last = epoch_log.last
    numbers = {k: v for k, v in last.items() if isinstance(v, (int, float)) and k not in ("epoch", "iteration")}
    numbers.update(zip(epoch_log.memory_tags(), last.get("peak_memory_mb", []), strict=False))
    for field in SPLIT_FIELDS:
        numbers.update({f"{field}/rank{k}": v for k, v in enumerate(last.get(field) or []) if v is not None})
    return numbers


class Trackers:
    """A context around ``trainer.run``: entering starts the trackers (rank 0; every rank takes part in gathering
    the GPUs), leaving ends their runs as FINISHED, KILLED (stopped by a signal) or FAILED. Without trackers it
    does nothing at all."""

    def __init__(
        self, cfg: Config, trainer: Engine, evaluator: Engine, optimizer: torch.optim.Optimizer, epoch_log: EpochLog,
        out: Path,
    ) -> None:  # fmt: skip
        self.cfg, self.trainer, self.evaluator, self.optimizer = cfg, trainer, evaluator, optimizer
        self.epoch_log, self.out = epoch_log, out
        self.started: list[Tracker] = []

    def __enter__(self) -> Trackers:
        names = trackers_of(self.cfg.train)
        if not names:
            return self
        gpus = job_gpus(self.epoch_log.devices)  # a collective: before rank 0 goes its own way
        if idist.get_rank() != 0:
            return self
        runs = self._remembered() if self.cfg.resume else None
        params = flat_config(self.cfg)
        facts = run_facts(idist.get_world_size(), self.epoch_log.restarts, gpus)
        for name in names:
            resumed = None if runs is None else runs.get(name, {})
            args = self.cfg.train.logger_args.get(name, {})
            try:
                backend = BACKENDS[name](args, self.out, self.trainer, resumed, params)
            # A bad URI, a server that does not answer, no credentials, ...
            except Exception as err:
                logger.warning(
                    "train.loggers: the %s tracker did not start (%s); training goes on without it.", name, _reason(err)
                )
                continue
            tracker = Tracker(backend)
            tracker.call("to record the run", backend.record_run, params, self.out / folder.CONFIG, facts)
            if tracker.alive:
                self._attach(tracker)
                self.started.append(tracker)
        self._remember()
        return self

    def _attach(self, tracker: Tracker) -> None:
        """The three handlers of one tracker: training loss and learning rate, validation metrics, epoch log."""
        backend, trainer = tracker.backend, self.trainer
        handler, attach = backend.output_handler, backend.logger.attach

        def iteration(*_: Any) -> int:
            return trainer.state.iteration

        def epoch(*_: Any) -> int:
            return trainer.state.epoch

        per_epoch = epoch if backend.epochs_as_steps else iteration
        train = handler(tag="train", output_transform=self._train_numbers, global_step_transform=iteration)
        attach(trainer, tracker.guarded(train), Events.ITERATION_COMPLETED(every=self.cfg.train.log_every))
        val = handler(tag="val", metric_names="all", global_step_transform=per_epoch)
        attach(self.evaluator, tracker.guarded(val), Events.COMPLETED)

        def log_epoch(engine: Engine) -> None:
            numbers = epoch_numbers(self.epoch_log) | ({} if backend.epochs_as_steps else {"epoch": engine.state.epoch})
            tracker.call("to log", backend.scalars, numbers, per_epoch())

        # After the epoch log's row: it reads that.
        trainer.add_event_handler(Events.EPOCH_COMPLETED, log_epoch)

    def _train_numbers(self, loss: torch.Tensor) -> dict[str, Any]:
        rates = [group["lr"] for group in self.optimizer.param_groups]
        return {"loss": loss, "lr": rates[0] if len(rates) == 1 else rates}

    def _remembered(self) -> dict[str, dict[str, str]]:
        """The tracker runs an interrupted run of this folder wrote (``{}`` when none, or unreadable)."""
        try:
            found = json.loads((self.out / folder.TRACKER_RUNS).read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def _remember(self) -> None:
        runs = {t.backend.name: t.backend.remembered() for t in self.started if t.backend.remembered()}
        if not runs:
            return
        path = self.out / folder.TRACKER_RUNS
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(self._remembered() | runs, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as err:  # the trackers run on; only a restart would start new tracker runs
            logger.warning("train.loggers: %s not written (%s); a restart starts new tracker runs.", path, _reason(err))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stopped = exc_type is not None and issubclass(exc_type, (TrainingInterrupted, KeyboardInterrupt))
        status = "FINISHED" if exc_type is None else "KILLED" if stopped else "FAILED"
        for tracker in self.started:
            tracker.call("to end its run", tracker.backend.close, status)
