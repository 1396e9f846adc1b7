"""Reading runs back and `ignite-mgpu report` in-process on hand-written run folders: the table's figures are the
file's, bad input is one message, no matplotlib still prints the table. The report of a real 2-process run is in
tests/distributed/test_training.py. `python -m pytest tests/runs/test_read.py`."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs import read as runs
from ignite_mgpu.runs.report import TABLE_EPOCHS, format_table
from tests.conftest import REPO

PNG = b"\x89PNG\r\n\x1a\n"


def epoch(n, memory=(875.2, 826.7), **fields):
    """One line of metrics.jsonl as the epoch report writes it (figures from a real 2-process CPU run)."""
    row = {
        "epoch": n,
        "iteration": 32 * n,
        "train_loss": 1.4340079522226006 / n,
        "val_loss": 0.05600495910644531 / n,
        "val_accuracy": 0.979,
        "samples_per_s": 3160.2 + n,
        "time_per_iter_ms": 40.504,
        "data_wait_share": 0.0179,
        "peak_memory_mb": list(memory),
        "peak_memory_per": "process",
        "memory_imbalance": round(max(memory) / min(memory), 3),
        "epoch_time_s": 1.296,
    }
    row.update(fields)
    return {k: v for k, v in row.items() if v is not ...}  # ... drops a field, as an older file lacks it


def make_run(folder, rows, strategy="ddp", nproc=2, nnodes=1, tail=""):
    """A run folder: config.yaml's dist section (as dump_config writes it) and metrics.jsonl (+ ``tail`` unended)."""
    folder.mkdir(parents=True)
    nproc_yaml = "null" if nproc is None else nproc
    (folder / "config.yaml").write_text(
        f"seed: 0\ndist:\n  nproc: {nproc_yaml}\n  backend: auto\n  strategy: {strategy}\n  nnodes: {nnodes}\n"
    )
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return folder


def report(*args):
    return CliRunner().invoke(main, ["report", *map(str, args)])


def assert_table_equals_metrics(table, path):
    """Every figure in the text table equals metrics.jsonl's, at the table's precision."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    lines = [line.split() for line in table.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(cells[0]) for cells in lines] == [r["epoch"] for r in rows][-TABLE_EPOCHS:]
    for cells, row in zip(lines, rows[-TABLE_EPOCHS:], strict=True):
        expected = [
            row["train_loss"],
            row["val_loss"],
            row["val_accuracy"],
            row["samples_per_s"],
            row["time_per_iter_ms"],
            100 * row["data_wait_share"],
            max(row["peak_memory_mb"]),
            row["memory_imbalance"],
        ]
        for cell, value, precision in zip(cells[1:], expected, (4, 4, 4, 1, 3, 2, 1, 3), strict=True):
            assert float(cell) == pytest.approx(value, abs=0.51 * 10**-precision), (cells, row)
    memory = " | ".join(f"rank {k} {mb:.1f}" for k, mb in enumerate(rows[-1]["peak_memory_mb"]))
    assert f"peak memory, epoch {rows[-1]['epoch']}, MB (process, peak RSS): {memory}" in table


def test_help_says_where_the_image_goes_and_what_draws_it():
    out = " ".join(report("--help").output.split())  # click wraps to the terminal's width
    assert "report [OPTIONS] RUN_DIR..." in out and "Where matplotlib (a dependency) cannot be imported" in out
    assert "[default: RUN_DIR/report.png for one run, ./report.png for several]" in out
    assert report().exit_code == 2  # click: Missing argument 'RUN_DIR...'


def test_the_table_has_the_files_figures(tmp_path):
    run = make_run(tmp_path / "ddp", [epoch(1), epoch(2, memory=(900.0, 450.0))])
    result = report(run)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"ddp (ddp, 2 processes, CPU): {run}"
    assert_table_equals_metrics(result.stdout, run / "metrics.jsonl")
    assert result.stderr == f"wrote {run / 'report.png'}\n"
    assert (run / "report.png").read_bytes().startswith(PNG)


def test_every_other_validation_metric_gets_a_column_even_one_the_report_does_not_know(tmp_path):
    rows = [epoch(1, val_top5=0.61, val_my_score=-2.5, val_per_class=[0.1, 0.9]), epoch(2, val_top5=0.7129)]
    run = make_run(tmp_path / "top5", rows)
    table = format_table(runs.read_runs([run]))
    header, first, second = (line.split() for line in table.splitlines()[1:4])
    assert header[:6] == ["epoch", "train_loss", "val_loss", "val_acc", "val_top5", "val_my_score"]
    assert first[4:6] == ["0.6100", "-2.5000"] and second[4:6] == ["0.7129", "-"]  # missing: "-"
    assert "val_per_class" not in table  # a list: --json has it
    assert header[6:] == ["samples/s", "ms/it", "data_wait_%", "peak_MB", "max/min"]


def test_a_long_run_shows_its_last_epochs(tmp_path):
    run = make_run(tmp_path / "long", [epoch(n) for n in range(1, 14)])
    table = format_table(runs.read_runs([run]))
    assert "(3 earlier epoch(s) not shown; --json has every epoch)" in table
    assert_table_equals_metrics(table, run / "metrics.jsonl")


def test_a_half_written_last_line_is_left_out_and_counted(tmp_path):
    line = json.dumps(epoch(3))
    run = make_run(tmp_path / "going", [epoch(1), epoch(2)], tail=line[: len(line) // 2])
    (read,) = runs.read_runs([run])
    assert [r["epoch"] for r in read.epochs] == [1, 2] and read.incomplete_lines == 1
    result = report(run)
    assert result.exit_code == 0, result.output
    assert f"going (ddp, 2 processes, CPU): {run} (1 incomplete line(s) ignored)" in result.stdout
    assert (run / "report.png").exists()


def test_a_repeated_epoch_keeps_its_later_line(tmp_path):
    # A resumed run repeats the epochs after its checkpoint; the later line is the one that counts.
    run = make_run(tmp_path / "resumed", [epoch(1), epoch(2, train_loss=9.0), epoch(2, train_loss=0.5), epoch(3)])
    (read,) = runs.read_runs([run])
    assert [r["epoch"] for r in read.epochs] == [1, 2, 3] and read.series("train_loss")[1] == 0.5


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (None, ": no such folder. Give the run's output_dir, the folder with metrics.jsonl."),
        ("config only", "has no metrics.jsonl, and no folder in it has one. A run appends one line to it after each"),
        ("", "has no complete line (0 incomplete line(s) ignored): the run has not finished its first epoch yet"),
        ('{"epoch": 1, "train_l', "has no complete line (1 incomplete line(s) ignored)"),
    ],
)
def test_a_folder_without_a_finished_epoch_is_exit_2_with_one_paragraph(tmp_path, write, message):
    folder = tmp_path / "run"
    if write is not None:
        folder.mkdir()
        (folder / "config.yaml").write_text("dist:\n  strategy: ddp\n")
        if write != "config only":
            (folder / "metrics.jsonl").write_text(write)
    good = make_run(tmp_path / "good", [epoch(1)])
    result = report(good, folder)  # one bad folder among good ones still stops the command
    assert result.exit_code == 2
    assert result.stderr.startswith(f"ignite-mgpu: error: {folder}") and message in result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "report.png").exists()


def test_an_unreadable_metrics_file_is_exit_2(tmp_path, monkeypatch):
    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(runs, "read_metrics", denied)  # root reads any file: chmod cannot show it here
    run = make_run(tmp_path / "run", [epoch(1)])
    result = report(run)
    assert result.exit_code == 2
    assert (
        result.stderr
        == f"ignite-mgpu: error: cannot read {run / 'metrics.jsonl'}: Permission denied. Check its permissions.\n"
    )


def test_labels_name_folder_strategy_and_processes(tmp_path):
    gpu = {"peak_memory_per": "gpu"}
    dp = make_run(tmp_path / "dp", [epoch(1, memory=(9000, 4000, 4000, 4000), **gpu)], strategy="dp", nproc=None)
    ddp = make_run(tmp_path / "ddp", [epoch(1, memory=(4100,) * 4, **gpu)], nproc=None)  # count from the ranks
    nodes = make_run(tmp_path / "nodes", [epoch(1, memory=(4100,) * 8, **gpu)], nproc=4, nnodes=2)
    cpu = make_run(tmp_path / "cpu", [epoch(1, memory=(800.0,))], nproc=1)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps(epoch(1, peak_memory_per=...)) + "\n")  # e.g. own code
    broken = make_run(tmp_path / "broken", [epoch(1)])
    (broken / "config.yaml").write_text("dist: [unclosed\n")
    other = make_run(tmp_path / "other", [epoch(1)])
    (other / "config.yaml").write_text("seed: 0\n")
    labels = [r.label for r in runs.read_runs([dp, ddp, nodes, cpu, bare, broken, other])]
    assert labels == [
        "dp (dp, 1 process, 4 GPUs)",
        "ddp (ddp, 4 processes)",
        "nodes (ddp, 8 processes on 2 nodes)",
        "cpu (ddp, 1 process, CPU)",
        "bare (no config.yaml)",
        "broken (config.yaml unreadable)",
        "other (config.yaml without dist)",
    ]


def test_a_folder_of_runs_compares_the_runs_in_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_run(tmp_path / "runs" / "ddp", [epoch(1), epoch(2)])
    make_run(tmp_path / "runs" / "dp", [epoch(1)], strategy="dp", nproc=1)
    (tmp_path / "runs" / "not_a_run").mkdir()  # no metrics.jsonl: not one of the runs
    result = report("runs")
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines() if ": runs/" in line] == [
        "ddp (ddp, 2 processes, CPU): runs/ddp",
        "dp (dp, 1 process, 2 GPUs): runs/dp",
    ]
    assert result.stderr == "wrote report.png\n"  # several runs: one image in the current folder
    assert [r.path for r in runs.read_runs(["runs", "runs/ddp"])] == [
        Path("runs/ddp"),
        Path("runs/dp"),
        Path("runs/ddp"),
    ]


def test_runs_with_the_same_folder_name_are_named_by_path(tmp_path):
    a, b = make_run(tmp_path / "a" / "run", [epoch(1)]), make_run(tmp_path / "b" / "run", [epoch(1)])
    assert [r.name for r in runs.read_runs([a, b])] == [str(a), str(b)]


def test_json_has_every_epoch_with_null_for_nan(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = make_run(tmp_path / "a", [epoch(1, val_loss=math.nan, val_accuracy=math.nan), epoch(2)], tail='{"ep')
    b = make_run(tmp_path / "b", [epoch(1, val_accuracy=...)], strategy="dp", nproc=None)
    result = report(a, b, "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)  # NaN is not JSON: it must be null
    assert found["image"] == "report.png" and (tmp_path / "report.png").exists()  # several runs: ./report.png
    first, second = found["runs"]
    assert first["label"] == "a (ddp, 2 processes, CPU)" and first["incomplete_lines"] == 1
    assert first["epochs"][0]["val_loss"] is None and first["epochs"][1] == epoch(2)
    assert second["strategy"] == "dp" and second["processes"] == 1 and "val_accuracy" not in second["epochs"][0]


def test_out_path_and_its_errors(tmp_path):
    run = make_run(tmp_path / "run", [epoch(1)])
    result = report(run, "--out", tmp_path / "new" / "cmp")  # folders are made; .png added
    assert result.exit_code == 0 and (tmp_path / "new" / "cmp.png").read_bytes().startswith(PNG)
    (tmp_path / "file").write_text("")
    for out, why in [(tmp_path / "file" / "x.png", "File exists"), (tmp_path / "x.xyz", "Format 'xyz'")]:
        result = report(run, "--out", out)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert result.stderr.startswith(f"ignite-mgpu: error: cannot write the image to {out}: ")
        assert why in result.stderr and result.stderr.endswith("Choose another --out (a .png file).\n")


def test_without_matplotlib_the_table_is_printed_and_the_fix_named(tmp_path, monkeypatch):
    for name in ["matplotlib", *(m for m in sys.modules if m.startswith("matplotlib."))]:
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib...` raises ImportError
    run = make_run(tmp_path / "run", [epoch(1), epoch(2)])
    result = report(run)
    assert result.exit_code == 0, result.output
    assert_table_equals_metrics(result.stdout, run / "metrics.jsonl")
    assert result.stderr.startswith("no image drawn: matplotlib, a dependency of ignite-mgpu, cannot be imported (")
    assert "`pip install matplotlib` installs it again" in result.stderr and not (run / "report.png").exists()
    assert json.loads(report(run, "--json").stdout)["image"] is None
    with pytest.raises(ConfigError, match="has no metrics.jsonl"):  # bad input is reported the same without it
        runs.read_run(tmp_path)


@pytest.mark.timeout(120)
def test_report_imports_neither_torch_nor_ignite(tmp_path):
    run = make_run(tmp_path / "run", [epoch(1)])
    check = (
        "import sys; from ignite_mgpu.cli.commands import main; "
        f"main(['report', {str(run)!r}, '--json'], standalone_mode=False); "
        "print(sorted(m for m in ('torch', 'ignite') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.splitlines()[-1] == "[]" and (run / "report.png").read_bytes().startswith(PNG)


def test_what_fit_returns_is_read_from_the_run_folder(tmp_path):
    assert runs.last_epoch(tmp_path) == {} and runs.best_model(tmp_path) is None  # nothing written yet
    (tmp_path / "metrics.jsonl").write_text(json.dumps(epoch(1)) + "\n" + json.dumps(epoch(2)) + '\n{"epo')
    assert runs.last_epoch(tmp_path) == epoch(2)
    for name in ("best_model_32_val_accuracy=0.9100.pt", "best_model_64_val_accuracy=0.9790.pt", "notes.pt"):
        (tmp_path / name).write_bytes(b"")
    assert runs.best_model(tmp_path) == tmp_path / "best_model_64_val_accuracy=0.9790.pt"
    (tmp_path / "best_model_96_val_loss=-0.0500.pt").write_bytes(b"")  # a loss is kept negated: higher is better
    (tmp_path / "best_model_32_val_accuracy=0.9100.pt").unlink()
    (tmp_path / "best_model_64_val_accuracy=0.9790.pt").unlink()
    (tmp_path / "best_model_128_val_loss=-0.0700.pt").write_bytes(b"")
    assert runs.best_model(tmp_path) == tmp_path / "best_model_96_val_loss=-0.0500.pt"
