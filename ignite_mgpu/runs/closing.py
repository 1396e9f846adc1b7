"""What a run says when it ends: three lines for a person (where the run is, its best model and that model's
metric, what to run next), and the stop line's checkpoint and how to go on. The figures themselves stay in
metrics.jsonl, one JSON line per epoch, for scripts. Torch-free: the worker's rank 0 and the tests read it."""

from __future__ import annotations

import shlex
from pathlib import Path

from ignite_mgpu.runs.folder import BEST_NAME, CONFIG, METRICS
from ignite_mgpu.text import plural


def _quoted(path: str | Path) -> str:
    return shlex.quote(str(path))


def go_on_command(output_dir: str | Path) -> str:
    """The command that continues the run in ``output_dir`` from its newest checkpoint: its own config.yaml (which
    names the folder) and ``--resume auto``."""
    return f"ignite-mgpu train {_quoted(Path(output_dir) / CONFIG)} --resume auto"


def closing_lines(output_dir: str | Path, best_model: str | Path | None, epochs: int, run_time_s: float) -> list[str]:
    """The end of a finished run, three lines: where the run is, the best model with its metric, what to run next
    (its report, the best model's evaluation, more epochs from the newest checkpoint)."""
    out = Path(output_dir)
    where = (
        f"finished: {plural(epochs, 'epoch')} in {run_time_s:.1f} s; the run is in {out}/ "
        f"(every epoch's figures: {out / METRICS})"
    )
    if best_model is None:
        best = "best model: none saved (no validation metric was computed)"
        evaluate = ""
    else:
        found = BEST_NAME.match(Path(best_model).name)
        metric = f" (val_{found[2]} {found[3]}, epoch {found[1]})" if found else ""
        best = f"best model: {best_model}{metric}"
        evaluate = f"`ignite-mgpu evaluate --config {_quoted(out / CONFIG)} --checkpoint {_quoted(best_model)}`, "
    more = f"`{go_on_command(out)} train.epochs={2 * epochs}`"
    return [where, best, f"next: `ignite-mgpu report {_quoted(out)}`, {evaluate}or more epochs: {more}"]


def stopped_line(output_dir: str | Path, checkpoint: Path | None) -> str:
    """What a stopped run (Ctrl-C, SIGTERM) adds to its stop message: the checkpoint it can go on from, and how."""
    if checkpoint is None:
        return f"no checkpoint in {output_dir} yet: the next run starts from the beginning"
    return f"last checkpoint {checkpoint}; go on from it with `{go_on_command(output_dir)}`"
