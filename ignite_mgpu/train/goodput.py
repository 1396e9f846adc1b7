"""Goodput accounting on the trainer: which part of the wall time (``runs/goodput_parts.PARTS``) the job is in, switched
at event boundaries (an epoch's start and end, the checkpoint handlers, the epoch log's line), never per iteration.
Rank 0 keeps the run's totals and the progress a restart resumes in ``goodput.json``."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events

from ignite_mgpu.env.clock import JobClock
from ignite_mgpu.runs.goodput_parts import summary, zero
from ignite_mgpu.train.step.guard import GuardEvents

# The progress at the last boundaries: a restart resumes the newest complete checkpoint's.
KEPT_RECORDS = 8


class Goodput:
    """The parts of this epoch and of the run so far, on this process's clock (rank 0's is the one written).

    ``attach`` before the trainer's other epoch-end handlers (the validation); attach the checkpoint handlers
    inside ``timing_checkpoints``; the epoch log calls ``line`` when it writes an epoch's line.
    """

    def __init__(self, path: str | Path, clock: JobClock, writer: bool) -> None:
        self.path, self.clock, self.writer = Path(path), clock, writer
        # The parts since the last line, and up to the last line.
        self.epoch, self.run = zero(), zero()
        # Iterations re-done after a restart: since the last line, in all.
        self.redone, self.run_redone = 0, 0
        self._state, self._mark = "startup", clock.started
        self._paused: list[str] = []  # the states a checkpoint handler interrupted
        self._records: list[dict[str, Any]] = []

    def attach(self, trainer: Engine) -> None:
        trainer.add_event_handler(Events.STARTED, self._started)
        trainer.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        # The iterations ended.
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._switch, "eval")
        trainer.add_event_handler(Events.COMPLETED, self._completed)

    @contextlib.contextmanager
    def timing_checkpoints(self, trainer: Engine, evaluator: Engine) -> Iterator[None]:
        """The checkpoint handlers attached inside are bracketed: their time is the checkpoint stall, whether
        they write (synchronous) or hand the write over (asynchronous)."""
        events = [(trainer, GuardEvents.CHECKPOINT), (trainer, GuardEvents.STOPPING), (evaluator, Events.COMPLETED)]
        for engine, event in events:
            engine.add_event_handler(event, self._checkpoint_started)
        yield
        trainer.add_event_handler(GuardEvents.CHECKPOINT, self._checkpoint_completed)
        trainer.add_event_handler(GuardEvents.STOPPING, self._checkpoint_completed)
        # The epoch's line saves the progress.
        evaluator.add_event_handler(Events.COMPLETED, self._checkpoint_ended)

    def _close(self) -> float:
        """The time since the last switch goes to the current part; returns now."""
        now = time.time()
        self.epoch[self._state] += max(0.0, now - self._mark)
        self._mark = now
        return now

    # No engine argument: ignite calls it with the state only.
    def _switch(self, state: str) -> None:
        self._close()
        self._state = state

    def _checkpoint_started(self) -> None:
        self._paused.append(self._state)
        self._switch("checkpoint")

    def _checkpoint_ended(self) -> None:
        self._switch(self._paused.pop() if self._paused else "other")

    # The trainer's: its progress is what was saved.
    def _checkpoint_completed(self, engine: Engine) -> None:
        self._checkpoint_ended()
        self._record(engine.state.iteration)

    def _epoch_started(self, engine: Engine) -> None:
        first = self._state in ("startup", "restart", "resize")
        self._switch("train")
        # The attempt's progress at its first iteration: a restart without a checkpoint goes on from it.
        if first:
            self._record(engine.state.iteration)

    def _started(self, engine: Engine) -> None:
        """The attempt's start: a restart goes on from the progress saved with the checkpoint it resumed."""
        resumed = engine.state.iteration
        restarted = self.clock.failed_at is not None
        saved = self._resumed_record(resumed) if resumed or restarted else None
        if saved is not None:
            self.run, self.epoch = dict(saved["run"]), dict(saved["epoch"])
            self.redone, self.run_redone = saved["redone"], saved["run_redone"]
        failed_at = self.clock.failed_at
        # Restarted by the supervisor: the failed attempt's time after its progress.
        if failed_at is not None:
            if saved is not None:
                self.epoch["lost"] += max(0.0, failed_at - saved["at"])
            # Counted into the run's at the epoch's line.
            self.redone += max(0, self.clock.reached - resumed)
            self._state, self._mark = "resize" if self.clock.resized_from else "restart", failed_at

    def _resumed_record(self, iteration: int) -> dict[str, Any] | None:
        """The progress saved at ``iteration`` (or the last before it: a checkpoint that was not completed)."""
        try:
            records = json.loads(self.path.read_text())["records"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        earlier = [r for r in records if isinstance(r, dict) and r.get("iteration", iteration + 1) <= iteration]
        self._records = earlier
        return max(earlier, key=lambda r: (r["iteration"], r["at"])) if earlier else None

    def line(self, data_wait: float, iteration: int) -> dict[str, Any]:
        """The epoch's fields for metrics.jsonl and the run's so far; the next epoch's parts start from zero, and
        rank 0 saves the progress. ``data_wait``: the slowest rank's wait for batches in this epoch (inside its
        iterations); ``iteration``: the trainer's at the epoch's end."""
        self._close()
        wait = min(data_wait, self.epoch["train"])
        self.epoch["train"] -= wait
        self.epoch["data_wait"] += wait
        fields = summary(self.epoch, self.redone)
        self.run = {part: self.run[part] + seconds for part, seconds in self.epoch.items()}
        self.run_redone += self.redone
        self.epoch, self.redone, self._state = zero(), 0, "other"
        total = summary(self.run, self.run_redone)
        self._record(iteration)
        return fields | {"run_time_s": total["time_wall_s"], "run_goodput": total["goodput"]}

    def _completed(self, engine: Engine) -> None:
        self._switch("other")
        self._record(engine.state.iteration)

    def _record(self, iteration: int) -> None:
        """Rank 0: the progress now (the run's totals, this epoch's parts so far) into goodput.json, atomically."""
        if not self.writer:
            return
        at = self._close()
        record = {
            "iteration": iteration,
            "at": at,
            "run": self.run,
            "epoch": self.epoch,
            "redone": self.redone,
            "run_redone": self.run_redone,
        }
        self._records = [*self._records, json.loads(json.dumps(record))][-KEPT_RECORDS:]
        parts = {part: self.run[part] + self.epoch[part] for part in self.run}
        content = {"run": summary(parts, self.run_redone + self.redone), "records": self._records}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(content))
        os.replace(tmp, self.path)
