"""Goodput in `ignite-mgpu report`: the run's totals (goodput.json, or the epochs' lines of a run without it), the
table's row per run, --json and the figure's stacked bars, on hand-written run folders.
`python -m pytest tests/runs/test_goodput.py`."""

import json

import pytest

from ignite_mgpu.runs import read as runs
from ignite_mgpu.runs.goodput_parts import FIELDS, PARTS, read_totals, summary
from ignite_mgpu.runs.report import GOODPUT_COLUMNS, GOODPUT_TITLE, format_table, to_json
from tests.runs.test_read import epoch, make_run

# Two epochs of a restarted 2-process run (figures from a real one, rounded); epoch 2 re-did 2 iterations.
FIRST = {"startup": 39.674, "train": 0.609, "data_wait": 0.044, "eval": 0.101, "checkpoint": 0.113}
SECOND = {"train": 0.469, "data_wait": 0.029, "eval": 0.021, "checkpoint": 0.062, "restart": 2.133, "lost": 0.232}


def timed(n, parts, redone=0):
    return epoch(n, **summary({p: parts.get(p, 0.0) for p in PARTS}, redone))


def test_summary_adds_the_parts_into_the_wall_time_and_the_share_training():
    line = summary({p: SECOND.get(p, 0.0) for p in PARTS}, 2)
    assert line["time_wall_s"] == pytest.approx(sum(SECOND.values()), abs=1e-3)
    assert line["goodput"] == pytest.approx(0.469 / sum(SECOND.values()), abs=1e-4)
    assert [k for k in line if k.startswith("time_")] == ["time_wall_s", *FIELDS.values()]


def test_the_totals_are_goodput_json_s_else_the_sum_of_the_lines(tmp_path):
    run = make_run(tmp_path / "restarted", [timed(1, FIRST), timed(2, SECOND, redone=2)])
    summed = read_totals(run, runs.read_run(run).epochs)
    assert summed["time_restart_s"] == 2.133 and summed["redone_iterations"] == 2
    assert summed["time_wall_s"] == pytest.approx(sum(FIRST.values()) + sum(SECOND.values()), abs=2e-3)
    final = summed | {"time_wall_s": 43.554, "time_other_s": 0.049}  # the time after the last line (its save)
    (run / "goodput.json").write_text(json.dumps({"run": final, "records": []}))
    assert runs.read_run(run).goodput == final
    old = make_run(tmp_path / "old", [epoch(1)])  # a run of a version without goodput
    assert runs.read_run(old).goodput == {} and read_totals(old, []) == {}


def test_the_table_has_a_goodput_row_per_run_and_json_the_totals(tmp_path):
    a = make_run(tmp_path / "restarted", [timed(1, FIRST), timed(2, SECOND, redone=2)])
    b = make_run(tmp_path / "old", [epoch(1)])
    found = runs.read_runs([a, b])
    table = format_table(found).splitlines()
    at = table.index(GOODPUT_TITLE)
    header, first, second = (line.split() for line in table[at + 1 : at + 4])
    assert header == list(GOODPUT_COLUMNS)
    assert first == ["restarted", "43.5", "39.7", "1.1", "0.1", "0.1", "0.2", "2.1", "0.0", "0.2", "0.0", "2", "2.5"]
    assert second == ["old", *["-"] * 10, "-", "-"]
    parsed = json.loads(to_json(found, None))["runs"]
    assert parsed[0]["goodput"]["time_restart_s"] == 2.133 and parsed[1]["goodput"] is None
    assert "goodput:" not in format_table(runs.read_runs([b]))  # nothing recorded: no block
    # The restarted run's start-up was 39.7 of its 43.5 s: said in words below the rows; the old run has none.
    (note,) = table[at + 4 :]
    assert note == (
        "  restarted: start-up took 39.7 of its 43.5 s. Start-up is paid once per run: a run this short is mostly "
        "start-up, a longer one trains for most of its time."
    )
    longer = make_run(tmp_path / "longer", [timed(1, FIRST | {"train": 40.0})])
    assert "start-up took" not in format_table(runs.read_runs([longer]))


def test_the_figure_stacks_each_runs_parts_in_one_bar(tmp_path):
    pytest.importorskip("matplotlib")
    from ignite_mgpu.runs.figure import TITLES, draw_report

    a = make_run(tmp_path / "restarted", [timed(1, FIRST), timed(2, SECOND, redone=2)])
    b = make_run(tmp_path / "clean", [timed(1, FIRST)])
    fig = draw_report(runs.read_runs([a, b]))
    (ax,) = [ax for ax in fig.axes if ax.get_title() == TITLES["goodput"]]
    widths = [[round(bar.get_width(), 3) for bar in container] for container in ax.containers]
    assert len(widths) == len(PARTS)
    restarted = {p: FIRST.get(p, 0.0) + SECOND.get(p, 0.0) for p in PARTS}
    assert [w[0] for w in widths] == pytest.approx([restarted[p] for p in PARTS], abs=2e-3)
    assert [w[1] for w in widths] == pytest.approx([FIRST.get(p, 0.0) for p in PARTS], abs=2e-3)
    assert [t.get_text() for t in ax.texts] == [" 2.5 % training", " 1.5 % training"]
    assert [t.get_text() for t in ax.get_legend().texts][:3] == ["start-up", "training", "data wait"]
    no_goodput = draw_report(runs.read_runs([make_run(tmp_path / "old", [epoch(1)])]))
    assert TITLES["goodput"] not in [ax.get_title() for ax in no_goodput.axes]
