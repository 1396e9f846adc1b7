"""The report figure, checked as a matplotlib Figure (panels, series, bar heights), never as pixels.
`python -m pytest tests/runs/test_figure.py`."""

import math

import pytest

from ignite_mgpu.runs import read as runs
from ignite_mgpu.runs.figure import TITLES, draw_report  # imports matplotlib only when drawing
from tests.runs.test_read import epoch, make_run

pytest.importorskip("matplotlib")  # the extra "plot" (in "dev")


def panels(fig):
    """Axes by their title's first word: Loss, Validation, Throughput, Data-loader, Peak."""
    return {ax.get_title().split()[0]: ax for ax in fig.axes}


def test_one_run_has_every_panel_and_series(tmp_path):
    run = make_run(tmp_path / "ddp", [epoch(1), epoch(2, memory=(900.0, 450.0))])
    fig = draw_report(runs.read_runs([run]))
    axes = panels(fig)
    assert [ax.get_title() for ax in fig.axes] == [
        TITLES["loss"],
        TITLES["accuracy"],
        TITLES["speed"],
        TITLES["wait"],
        "Peak memory per process, epoch 2 (max/min 2.00)",
    ]
    label = "ddp (ddp, 2 processes, CPU)"
    assert [t.get_text() for t in fig.legends[0].texts] == [label]
    loss = axes["Loss"].lines
    assert [line.get_label() for line in loss] == [f"{label}: train", f"{label}: validation"]
    assert list(loss[0].get_xdata()) == [1, 2] and list(loss[0].get_ydata()) == [1.4340079522226006, 0.7170039761113003]
    assert list(axes["Validation"].lines[0].get_ydata()) == pytest.approx([97.9, 97.9])  # in %
    assert list(axes["Throughput"].lines[0].get_ydata()) == [3161.2, 3162.2]
    assert list(axes["Data-loader"].lines[0].get_ydata()) == pytest.approx([1.79, 1.79])
    memory = axes["Peak"]
    assert [bar.get_height() for bar in memory.patches] == [900.0, 450.0]
    assert [t.get_text() for t in memory.get_xticklabels()] == ["rank 0", "rank 1"]
    assert memory.get_ylabel() == "MB (process, peak RSS)" and axes["Loss"].get_xlabel() == "epoch"


def test_dp_and_ddp_overlaid(tmp_path):
    gpu = {"peak_memory_per": "gpu"}
    dp = make_run(tmp_path / "dp", [epoch(1, memory=(9000, 4000, 4000, 4000), **gpu)], strategy="dp", nproc=None)
    ddp = make_run(tmp_path / "ddp", [epoch(1, memory=(4100, 4000, 4050, 4000), **gpu)], nproc=4)
    fig = draw_report(runs.read_runs([dp, ddp]))
    labels = ["dp (dp, 1 process, 4 GPUs)", "ddp (ddp, 4 processes)"]
    assert [t.get_text() for t in fig.legends[0].texts] == labels
    axes = panels(fig)
    assert [line.get_label() for line in axes["Throughput"].lines] == labels
    assert [line.get_color() for line in axes["Throughput"].lines] == ["C0", "C1"]
    memory = axes["Peak"]
    assert memory.get_title() == "Peak memory, epoch 1 (max/min: dp 2.25, ddp 1.02)"
    bars = memory.containers
    assert [b.get_label() for b in bars] == labels
    assert [p.get_height() for p in bars[0]] == [9000, 4000, 4000, 4000]
    assert [p.get_height() for p in bars[1]] == [4100, 4000, 4050, 4000]
    assert memory.get_xticklabels()[0].get_text() == "cuda:0 (dp) / rank 0"
    assert memory.get_ylabel() == "MB (GPU, peak allocated)"


def test_accuracy_where_there_is_one_and_nan_as_gaps(tmp_path):
    with_acc = make_run(tmp_path / "cls", [epoch(1), epoch(2)])
    without = make_run(tmp_path / "reg", [epoch(1, val_accuracy=...), epoch(2, val_accuracy=...)])
    no_val = make_run(tmp_path / "noval", [epoch(1, val_loss=math.nan, val_accuracy=math.nan), epoch(2)])
    found = runs.read_runs([with_acc, without, no_val])
    axes = panels(draw_report(found))
    assert [line.get_label() for line in axes["Validation"].lines] == [found[0].label, found[2].label]
    gap = axes["Validation"].lines[1].get_ydata()
    assert math.isnan(gap[0]) and gap[1] == pytest.approx(97.9)  # the epoch without validation is a gap, not a zero
    assert len(axes["Loss"].lines) == 6

    alone = panels(draw_report(runs.read_runs([without])))
    assert not alone["Validation"].lines
    assert [t.get_text() for t in alone["Validation"].texts] == ["no validation accuracy in these runs"]


def test_where_each_ranks_step_went_is_a_row_of_stacked_bars(tmp_path):
    split = {
        "time_data_ms": [0.3, 170.1],
        "time_compute_ms": [21.4, 3.2],
        "time_comm_ms": [158.6, 3.5],
        "time_optimizer_ms": [0.4, 0.4],
    }
    older = make_run(tmp_path / "older", [epoch(1)])  # a metrics.jsonl without the split: no bars of its own
    fig = draw_report(runs.read_runs([make_run(tmp_path / "slow", [epoch(1, **split)]), older]))
    step = fig.axes[-1]
    assert step.get_title() == TITLES["step"]
    assert [t.get_text() for t in step.get_yticklabels()] == ["slow, rank 0", "slow, rank 1"]
    labels = ["data wait", "forward + backward", "all-reduce wait", "optimizer"]
    assert [c.get_label() for c in step.containers] == labels
    widths = [[p.get_width() for p in c] for c in step.containers]
    assert widths == [pytest.approx(v) for v in split.values()]
    unmeasured = {**split, "time_comm_ms": [None, None]}  # FSDP: inside forward + backward
    fig = draw_report(runs.read_runs([make_run(tmp_path / "fsdp", [epoch(1, **unmeasured)])]))
    assert [p.get_width() for p in fig.axes[-1].containers[2]] == [0.0, 0.0]
    assert [t.get_text() for t in fig.axes[-1].get_yticklabels()] == ["rank 0", "rank 1"]
