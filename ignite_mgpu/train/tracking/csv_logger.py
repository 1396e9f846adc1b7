"""The csv tracker: ignite's logger interface (``attach_output_handler``, ``OutputHandler``) over a plain CSV file
in the run folder (``runs.folder.TRACKING_CSV``), one row per number logged, read back with ``csv.DictReader``."""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events
from ignite.handlers.base_logger import BaseLogger, BaseOptimizerParamsHandler, BaseOutputHandler

# Long format: a new metric name is a new row, never a new column, so files of any run read alike.
# kind: train (every train.log_every iterations), val (each validation), epoch (the epoch log), run (each start);
# epoch and iteration: the trainer's when the row was written; time: seconds since 1970.
COLUMNS = ("time", "kind", "epoch", "iteration", "name", "value")


class CsvLogger(BaseLogger):
    """Appends rows to ``path`` (header first in a new file); the epoch and iteration of each row are the
    ``trainer``'s. ``keep_until``: a resumed run's iteration: rows the interrupted run wrote after it go (atomic)."""

    def __init__(self, path: str | Path, trainer: Engine, keep_until: int | None = None) -> None:
        self.path, self.trainer = Path(path), trainer
        if keep_until is not None:
            self._drop_rows_after(keep_until)
        new = not self.path.is_file() or self.path.stat().st_size == 0
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, COLUMNS)
        if new:
            self._writer.writeheader()
            self._file.flush()

    def _drop_rows_after(self, iteration: int) -> None:
        if not self.path.is_file():
            return
        with self.path.open(newline="") as f:
            rows = [
                r
                for r in csv.DictReader(f)
                if (r.get("iteration") or "").isdigit() and int(r["iteration"]) <= iteration
            ]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def log(self, kind: str, values: dict[str, Any]) -> None:
        """One row per entry of ``values``, at the trainer's current epoch and iteration; flushed at once."""
        state, now = self.trainer.state, round(time.time(), 3)
        for name, value in values.items():
            row = {"time": now, "kind": kind, "epoch": state.epoch, "iteration": state.iteration}
            self._writer.writerow(row | {"name": name, "value": value})
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _create_output_handler(self, *args: Any, **kwargs: Any) -> OutputHandler:
        return OutputHandler(*args, **kwargs)

    def _create_opt_params_handler(self, *args: Any, **kwargs: Any) -> OptimizerParamsHandler:
        return OptimizerParamsHandler(*args, **kwargs)


class OutputHandler(BaseOutputHandler):
    """ignite's output handler for the CSV file: the metrics, output or state attributes named as the other
    trackers name them (``val/accuracy``), in rows of kind ``tag``. The rows carry the trainer's epoch and
    iteration, so ``global_step_transform`` is not needed."""

    def __call__(self, engine: Engine, logger: CsvLogger, event_name: str | Events) -> None:
        if not isinstance(logger, CsvLogger):
            raise TypeError("the csv OutputHandler works only with CsvLogger")
        logger.log(self.tag, self._setup_output_metrics_state_attrs(engine, key_tuple=False))


class OptimizerParamsHandler(BaseOptimizerParamsHandler):
    """An optimizer parameter of each group (``lr/group_0``, ...), in rows of kind ``tag`` (or ``train``)."""

    def __call__(self, engine: Engine, logger: CsvLogger, event_name: str | Events) -> None:
        if not isinstance(logger, CsvLogger):
            raise TypeError("the csv OptimizerParamsHandler works only with CsvLogger")
        prefix = f"{self.tag}/" if self.tag else ""
        groups = enumerate(self.optimizer.param_groups)
        logger.log(self.tag or "train", {f"{prefix}{self.param_name}/group_{i}": g[self.param_name] for i, g in groups})
