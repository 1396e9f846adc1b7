"""The picture of one or several runs for ``ignite-mgpu report``: loss, accuracy, throughput and data wait per epoch,
the peak memory of each GPU or process and where each rank's step went in the last epoch, written to an image file.
matplotlib is the optional extra ``plot``, imported only when drawing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs.folder import REPORT_IMAGE
from ignite_mgpu.runs.goodput_parts import FIELDS, PARTS
from ignite_mgpu.runs.read import Run, memory_kind, memory_names

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

REINSTALL = "pip install matplotlib"
TITLES = {
    "loss": "Loss (train: solid, validation: dashed)",
    "accuracy": "Validation accuracy",
    "speed": "Throughput",
    "wait": "Data-loader wait",
    "memory": "Peak memory",  # the figure's title adds the epoch and max/min
    "goodput": "Goodput: where the wall time went",
    "step": "Where each rank's step went, last epoch",
}
# The step's parts per rank (metrics.jsonl's time_<part>_ms), in the bars' order.
STEP_PARTS = {"data": "data wait", "compute": "forward + backward", "comm": "all-reduce wait", "optimizer": "optimizer"}
PART_NAMES = {
    "startup": "start-up",
    "train": "training",
    "data_wait": "data wait",
    "eval": "evaluation",
    "checkpoint": "checkpoint stall",
    "restart": "restarts",
    "resize": "changes of size",
    "lost": "lost to restarts",
    "other": "other",
}


def image_path(runs: list[Run], out: str | None) -> Path:
    """Where the image goes: ``--out`` (.png added without a suffix), else RUN_DIR/report.png for one run and
    report.png in the current folder for several."""
    if out:
        path = Path(out)
        return path if path.suffix else path.with_suffix(".png")
    return runs[0].path / REPORT_IMAGE if len(runs) == 1 else Path(REPORT_IMAGE)


def write_image(runs: list[Run], out: str | None) -> tuple[Path | None, str]:
    """Draw the runs into an image file; returns its path and a line to print, or (None, why) without matplotlib.

    Raises:
        ConfigError: the image cannot be written there (a folder, no permission, a format matplotlib lacks).
    """
    path = image_path(runs, out)
    try:
        figure = draw_report(runs)
    except ImportError as err:
        return None, (
            f"no image drawn: matplotlib, a dependency of ignite-mgpu, cannot be imported ({err}). `{REINSTALL}` "
            "installs it again; the table has the same figures."
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=80)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot write the image to {path}: {err}. Choose another --out (a .png file).") from err
    return path, f"wrote {path}"


def draw_report(runs: list[Run]) -> Figure:
    """The report figure of ``runs``, overlaid with one colour per run; a legend above names each run.

    Built on a bare ``Figure`` without pyplot: it needs no display and leaves the caller's backend alone (saving a
    PNG renders with Agg). NaN values (no validation) are gaps.

    Raises:
        ImportError: matplotlib is not installed (the extra ``plot``).
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    goodput = any(run.goodput for run in runs)
    step = any(_has_split(run) for run in runs)
    fig = Figure(figsize=(10, 10.5 + 3 * goodput + 2.5 * step), layout="constrained")
    axes = _panels(fig, goodput, step)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors, strict=True):
        epochs = run.series("epoch")
        axes["loss"].plot(epochs, run.series("train_loss"), "o-", color=color, label=f"{run.label}: train")
        if run.has("val_loss"):
            axes["loss"].plot(epochs, run.series("val_loss"), "s--", color=color, label=f"{run.label}: validation")
        if run.has("val_accuracy"):
            accuracy = [100 * v for v in run.series("val_accuracy")]
            axes["accuracy"].plot(epochs, accuracy, "o-", color=color, label=run.label)
        axes["speed"].plot(epochs, run.series("samples_per_s"), "o-", color=color, label=run.label)
        wait = [100 * v for v in run.series("data_wait_share")]
        axes["wait"].plot(epochs, wait, "o-", color=color, label=run.label)
    losses = [v for r in runs for key in ("train_loss", "val_loss") for v in r.series(key) if math.isfinite(v)]
    # The first epoch's loss would flatten every later one on a linear axis.
    if losses and min(losses) > 0:
        axes["loss"].set(yscale="log", ylabel="mean loss per sample (log scale)")
    # A throughput axis from zero: small changes do not look like collapses.
    axes["speed"].set_ylim(bottom=0)
    axes["wait"].set_ylim(0, max(10.0, axes["wait"].get_ylim()[1]))  # a 2 % wait should look small
    if not axes["accuracy"].lines:
        axes["accuracy"].text(0.5, 0.5, "no validation accuracy in these runs", ha="center", va="center")
        axes["accuracy"].set(xticks=[], yticks=[])
    style = [Line2D([], [], color="gray", ls="-", marker="o"), Line2D([], [], color="gray", ls="--", marker="s")]
    axes["loss"].legend(style, ["train", "validation"], fontsize="small")
    _memory_bars(axes["memory"], runs, colors)
    if goodput:
        _goodput_bars(axes["goodput"], runs)
    if step:
        _step_bars(axes["step"], runs)
    handles = [Line2D([], [], color=c, lw=6) for c in colors]
    fig.legend(handles, [r.label for r in runs], loc="outside upper center", ncols=min(len(runs), 2))
    return fig


def _memory_bars(ax: Axes, runs: list[Run], colors: list[str]) -> None:
    """Grouped bars: one group per GPU or rank index, one bar per run, each labelled with its MB."""
    width = 0.6 / len(runs)
    # 8 GPUs x 3 runs: labels side by side would overlap.
    crowded = sum(len(r.memory) for r in runs) > 16
    for i, (run, color) in enumerate(zip(runs, colors, strict=True)):
        offset = (i - (len(runs) - 1) / 2) * width
        bars = ax.bar([k + offset for k in range(len(run.memory))], run.memory, width, color=color, label=run.label)
        ax.bar_label(bars, fmt="%.0f", fontsize="small", rotation=90 if crowded else 0, padding=2)
    widest = max(runs, key=lambda r: len(r.memory))
    ax.set_xticks(range(len(widest.memory)), _tick_labels(runs, len(widest.memory)))
    kinds = {memory_kind(r) for r in runs}
    ax.set_ylabel(f"MB ({kinds.pop()})" if len(kinds) == 1 else "MB (GPU: peak allocated; process: peak RSS)")
    ax.margins(y=0.15)  # room for the bar labels
    ax.grid(axis="y", alpha=0.3)
    epochs = {r.last["epoch"] for r in runs}
    when = f"epoch {epochs.pop()}" if len(epochs) == 1 else "last epoch"
    ratios = [_ratio(r) for r in runs]
    if len(runs) == 1:
        ax.set_title(f"{TITLES['memory']} per {_entry(runs[0])}, {when} (max/min {ratios[0]})")
    else:
        shown = ", ".join(f"{r.name} {ratio}" for r, ratio in zip(runs, ratios, strict=True))
        ax.set_title(f"{TITLES['memory']}, {when} (max/min: {shown})")


def _panels(fig: Figure, goodput: bool, step: bool) -> dict[str, Axes]:
    """The figure's axes by name, titled and labelled; a goodput row where a run has goodput figures, a row of the
    step's split where one has it."""
    from matplotlib.ticker import MaxNLocator

    grid = fig.add_gridspec(3 + goodput + step, 2, height_ratios=[1, 1, 1] + [0.7] * (goodput + step))
    axes = {
        "loss": fig.add_subplot(grid[0, 0]),
        "accuracy": fig.add_subplot(grid[0, 1]),
        "speed": fig.add_subplot(grid[1, 0]),
        "wait": fig.add_subplot(grid[1, 1]),
        "memory": fig.add_subplot(grid[2, :]),
    }
    ylabels = {
        "loss": "mean loss per sample",
        "accuracy": "accuracy (%)",
        "speed": "samples/s (all processes)",
        "wait": "% of training time (slowest rank)",
    }
    for key, ax in axes.items():
        ax.set_title(TITLES[key])
        if key in ylabels:
            ax.set(xlabel="epoch", ylabel=ylabels[key])
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # one epoch: one tick, "1"
            ax.grid(alpha=0.3)
    if goodput:
        axes["goodput"] = fig.add_subplot(grid[3, :])
    if step:
        axes["step"] = fig.add_subplot(grid[3 + goodput, :])
    return axes


def _has_split(run: Run) -> bool:
    return isinstance(run.last.get("time_compute_ms"), list)


def _step_bars(ax: Axes, runs: list[Run]) -> None:
    """One horizontal bar per rank of each run's last epoch, stacked by where its iterations went (milliseconds per
    iteration; an unmeasured all-reduce wait is inside forward + backward)."""
    ax.set_title(TITLES["step"])
    rows = [(r, k) for r in runs if _has_split(r) for k in range(len(r.last["time_compute_ms"]))]
    names = [f"{r.name}, rank {k}" if len(runs) > 1 else f"rank {k}" for r, k in rows]
    left = [0.0] * len(rows)
    for i, (part, label) in enumerate(STEP_PARTS.items()):
        widths = [float(r.last[f"time_{part}_ms"][k] or 0.0) for r, k in rows]
        ax.barh(names, widths, left=left, color=f"C{i}", label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()  # rank 0 on top
    ax.set_xlabel("milliseconds per iteration")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), fontsize="small", ncols=len(STEP_PARTS))


def _goodput_bars(ax: Axes, runs: list[Run]) -> None:
    """One horizontal bar per run, stacked by the parts of its wall time in the legend's
    colours; the run's goodput (the share spent training) at the bar's end."""
    ax.set_title(TITLES["goodput"])
    names = [r.name for r in runs]
    left = [0.0] * len(runs)
    for i, part in enumerate(PARTS):
        widths = [float(r.goodput.get(FIELDS[part]) or 0.0) for r in runs]
        ax.barh(names, widths, left=left, color=f"C{i}", label=PART_NAMES[part])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for k, run in enumerate(runs):
        share = run.goodput.get("goodput")
        text = f" {100 * share:.1f} % training" if isinstance(share, (int, float)) and math.isfinite(share) else " -"
        ax.text(left[k], k, text, va="center", fontsize="small")
    ax.invert_yaxis()  # the first run on top, as in the legend
    ax.set_xlabel("seconds (the command's start to the end of training)")
    ax.margins(x=0.15)  # room for the share
    ax.grid(axis="x", alpha=0.3)
    # In rows of five: one row of every part is wider than the figure.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize="small", ncols=min(len(PARTS), 5))


def _entry(run: Run) -> str:
    return "GPU" if run.strategy == "dp" else "process" if run.memory_per == "process" else "rank"


def _tick_labels(runs: list[Run], n: int) -> list[str]:
    """ "rank k" or "cuda:k" where every run agrees on what index k is, else both names."""
    names = {tuple(memory_names(r)) for r in runs if len(r.memory) == n}
    if len(names) == 1:
        return list(names.pop())
    return [f"cuda:{k} (dp) / rank {k}" for k in range(n)]


def _ratio(run: Run) -> str:
    """max/min of the last epoch's memory as the file has it (or from the entries, for a file without it)."""
    value = run.last.get("memory_imbalance")
    if isinstance(value, (int, float)):
        return f"{value:.2f}"
    memory = [mb for mb in run.memory if mb > 0]
    return f"{max(memory) / min(memory):.2f}" if memory else "-"
