"""The text table and the JSON of ``ignite-mgpu report``, from the runs as read. Torch-free."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ignite_mgpu.runs.goodput_parts import FIELDS, PARTS
from ignite_mgpu.runs.read import Run, as_number, memory_kind, memory_names

TABLE_EPOCHS = 10  # the text table shows the last epochs; --json has every one


def _cell(value: float, fmt: str, scale: float = 1.0) -> str:
    return format(value * scale, fmt) if math.isfinite(value) else "-"


def _row(row: dict[str, Any], extra: list[str]) -> list[str]:
    peak = [as_number(mb) for mb in row.get("peak_memory_mb") or []]
    return [
        str(row["epoch"]),
        _cell(as_number(row.get("train_loss")), ".4f"),
        _cell(as_number(row.get("val_loss")), ".4f"),
        _cell(as_number(row.get("val_accuracy")), ".4f"),
        *(_cell(as_number(row.get(key)), ".4f") for key in extra),
        _cell(as_number(row.get("samples_per_s")), ".1f"),
        _cell(as_number(row.get("time_per_iter_ms")), ".3f"),
        _cell(as_number(row.get("data_wait_share")), ".2f", 100),
        _cell(max(peak, default=math.nan), ".1f"),
        _cell(as_number(row.get("memory_imbalance")), ".3f"),
    ]


COLUMNS = ("epoch", "train_loss", "val_loss", "val_acc", "samples/s", "ms/it", "data_wait_%", "peak_MB", "max/min")
# Every other validation metric (eval.metrics) gets a column after val_acc.
SHOWN = ("val_loss", "val_accuracy")


def validation_columns(run: Run) -> list[str]:
    """The run's other validation metrics (``val_top5``, ``val_f1``, a metric of the user's...), in the order the
    epochs first have them: each with a number in some epoch (a list, e.g. per-class scores, is --json's only)."""
    keys = dict.fromkeys(k for row in run.epochs for k in row if k.startswith("val_") and k not in SHOWN)
    return [k for k in keys if run.has(k)]


def format_table(runs: list[Run]) -> str:
    """The text table: per run a header, one row per epoch (the last TABLE_EPOCHS) and the last epoch's memory.
    Figures are the file's, at its own precision (losses and validation metrics at 4 decimals); "-" for NaN or
    missing."""
    blocks = []
    for run in runs:
        ignored = f" ({run.incomplete_lines} incomplete line(s) ignored)" if run.incomplete_lines else ""
        lines = [f"{run.label}: {run.path}{ignored}"]
        hidden = len(run.epochs) - TABLE_EPOCHS
        if hidden > 0:
            lines.append(f"  ({hidden} earlier epoch(s) not shown; --json has every epoch)")
        extra = validation_columns(run)
        header = [*COLUMNS[:4], *extra, *COLUMNS[4:]]
        rows = [header] + [_row(row, extra) for row in run.epochs[-TABLE_EPOCHS:]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        names = memory_names(run)
        entries = " | ".join(f"{n} {_cell(mb, '.1f')}" for n, mb in zip(names, run.memory, strict=True))
        lines.append(f"  peak memory, epoch {run.last['epoch']}, MB ({memory_kind(run)}): {entries or '-'}")
        blocks.append("\n".join(lines))
    if any(run.goodput for run in runs):
        blocks.append(format_goodput(runs))
    return "\n\n".join(blocks)


GOODPUT_COLUMNS = ("run", "wall_s", *PARTS, "redone_it", "goodput_%")
GOODPUT_TITLE = "goodput: the run's wall time and its parts, in seconds (the command's start to the end of training)"


def format_goodput(runs: list[Run]) -> str:
    """Where each run's wall time went: the wall time and each part in seconds, the iterations that restarts
    re-did and the share spent training; "-" for a run that recorded none."""
    rows = [list(GOODPUT_COLUMNS)]
    for run in runs:
        g = run.goodput
        seconds = [_cell(as_number(g.get(key)), ".1f") for key in ("time_wall_s", *FIELDS.values())]
        redone = str(g["redone_iterations"]) if "redone_iterations" in g else "-"
        rows.append([run.name, *seconds, redone, _cell(as_number(g.get("goodput")), ".1f", 100)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(GOODPUT_COLUMNS))]
    lines = [GOODPUT_TITLE]
    for r in rows:
        lines.append(
            "  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
    return "\n".join(lines + _mostly_startup(runs))


def _mostly_startup(runs: list[Run]) -> list[str]:
    """A line for each run whose start-up took half its wall time or more: its goodput says how short it was."""
    lines = []
    for run in runs:
        wall, startup = as_number(run.goodput.get("time_wall_s")), as_number(run.goodput.get(FIELDS["startup"]))
        if math.isfinite(wall) and math.isfinite(startup) and wall > 0 and startup >= wall / 2:
            lines.append(
                f"  {run.name}: start-up took {startup:.1f} of its {wall:.1f} s. Start-up is paid once per run: a "
                "run this short is mostly start-up, a longer one trains for most of its time."
            )
    return lines


def _finite_or_none(value: Any) -> Any:
    """JSON without NaN: NaN and Infinity become null (json.loads of our own lines gives floats for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value


def to_json(runs: list[Run], image: Path | None) -> str:
    """One JSON object for scripts: every epoch of every run (NaN as null) and the image's path (null if none)."""
    found = [
        {
            "run": str(r.path),
            "label": r.label,
            "strategy": r.strategy,
            "processes": r.processes if r.strategy else None,
            "nnodes": r.nnodes if r.strategy else None,
            "peak_memory_per": r.memory_per,
            "incomplete_lines": r.incomplete_lines,
            "goodput": r.goodput or None,
            "epochs": r.epochs,
        }
        for r in runs
    ]
    return json.dumps(_finite_or_none({"runs": found, "image": str(image) if image else None}), allow_nan=False)
