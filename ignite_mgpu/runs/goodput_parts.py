"""Goodput: where a run's wall time went. The parts' names, the fields they become in ``metrics.jsonl`` and
``goodput.json``, and the run's totals as ``ignite-mgpu report`` reads them back. Torch-free: the training layer
measures (``train/goodput.py``), this module names and adds."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ignite_mgpu.runs.folder import GOODPUT

# Disjoint parts of the wall time, each measured on rank 0's clock between event boundaries (never per iteration):
PARTS = (
    # The command's start to the first iteration: interpreter, imports, process group, data, model.
    "startup",
    "train",  # inside the epochs' iterations, less the data wait and the checkpoint stalls there
    "data_wait",  # waiting for the data loader (the slowest rank's wait)
    "eval",  # from the end of an epoch's iterations to its line in metrics.jsonl: the validation
    # The training loop inside the checkpoint handlers (periodic, epoch-end, on stop, best model)
    "checkpoint",
    "restart",  # a restart: from the failure to the first iteration of the restarted group
    # A restart on another number of processes (a failed GPU left out): the same span, apart
    "resize",
    "lost",  # a restart: from the last saved progress to the failure (the iterations it re-does)
    "other",  # between epochs, after the line: the trackers and the other epoch-end handlers
)
FIELDS = {part: f"time_{part}_s" for part in PARTS}  # the fields of metrics.jsonl and goodput.json
MEASURED = tuple(p for p in PARTS if p != "other")  # what the test adds up against the wall time


def zero() -> dict[str, float]:
    return dict.fromkeys(PARTS, 0.0)


def summary(parts: Mapping[str, float], redone_iterations: int) -> dict[str, Any]:
    """The fields of some span of a run: its wall time (the sum of its disjoint parts), each part, the iterations
    that restarts re-did and the goodput (the share of the wall time spent training)."""
    wall = sum(parts.values())
    return {
        "time_wall_s": round(wall, 3),
        **{FIELDS[p]: round(parts[p], 3) for p in PARTS},
        "redone_iterations": redone_iterations,
        "goodput": round(parts["train"] / wall, 4) if wall > 0 else math.nan,
    }


def read_totals(folder: Path, epochs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's totals: ``goodput.json``'s (the time after the last epoch's line included), else the sum of the
    epochs' lines; {} where neither has them (a run of an older version)."""
    try:
        totals = json.loads((folder / GOODPUT).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        totals = None
    if isinstance(totals, dict) and "time_wall_s" in totals:
        return totals
    rows = [row for row in epochs if "time_wall_s" in row]
    if not rows:
        return {}
    parts = {p: sum(float(row.get(FIELDS[p]) or 0.0) for row in rows) for p in PARTS}
    return summary(parts, sum(int(row.get("redone_iterations") or 0) for row in rows))
