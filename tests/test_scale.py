"""``ignite-mgpu scale`` as users run it: the table and its JSON on 1 and 2 CPU processes, its 2-process figure against
a real 2-process training run of the same step, nothing left behind (no run folder, no temporary folder), a failed
size named with its files kept, and the requests refused before anything starts.
`python -m pytest tests/test_scale.py -q`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, run_cli

SMALL = [a for a in TINY if not a.startswith("train.epochs")]


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """One scale run (--json) in an empty folder, with its own TMPDIR: the sizes, its output and the folders."""
    cwd = tmp_path_factory.mktemp("scale")
    tmp = cwd / "tmp"
    tmp.mkdir()
    out = run_cli(["scale", *SMALL, "--nproc", "2", "--iters", "100", "--json"], cwd, 240, {"TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), out, cwd, tmp


@pytest.mark.slow
def test_scale_measures_one_and_two_processes_with_the_efficiency(scaled):
    report, out, _, _ = scaled
    one, two = report["sizes"]
    assert (one["devices"], one["global_batch"], two["devices"], two["global_batch"]) == (1, 16, 2, 32)
    assert two["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"], rel=1e-3)
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2, rel=1e-3)
    ideal = one["time_per_iter_ms"]  # the same batch per process: one process's step
    assert sum(two["lost_ms"].values()) == pytest.approx(two["time_per_iter_ms"] - ideal, abs=0.05)
    assert report["verdict"].startswith("2 processes: ") and "scaling efficiency" in report["verdict"]
    assert report["device"] == "cpu" and report["published"] is None
    # Each size said once on stderr; the workers' epoch lines are not.
    assert out.stderr.count("ignite-mgpu scale: ") == 2 and "INFO epoch" not in out.stderr


@pytest.mark.slow
def test_scale_leaves_no_run_folder_and_no_temporary_folder(scaled):
    _, _, cwd, tmp = scaled
    assert sorted(p.name for p in cwd.iterdir()) == ["tmp"]
    assert [p for p in tmp.iterdir() if p.name.startswith("ignite-mgpu-scale-")] == []


@pytest.mark.slow
def test_the_two_process_figure_is_that_of_a_real_two_process_run(scaled, tmp_path):
    report, _, _, _ = scaled
    args = [*SMALL, "data.batch_size=32", "train.epoch_length=100", "train.epochs=2", "checkpoint.every=0"]
    out = run_cli(["train", *args, "--nproc", "2", "--output-dir", str(tmp_path / "run")], tmp_path, 240)
    assert out.returncode == 0, out.stderr[-3000:]
    trained = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    # Milliseconds per iteration of a few-millisecond step on a shared 2-core machine: within noise, not equal.
    ratio = report["sizes"][1]["time_per_iter_ms"] / trained["time_per_iter_ms"]
    assert 0.6 < ratio < 1.6, (report["sizes"][1], trained)


@pytest.mark.slow
def test_a_size_that_fails_stops_the_measure_and_keeps_its_files(tmp_path):
    env = {
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'faults'}",
        "FAULT": "raise:1:3",
        "TMPDIR": str(tmp_path),
    }
    args = ["scale", *SMALL, "data.image_size=32", "model.name=faultmod:make", "--nproc", "2", "--iters", "4"]
    out = run_cli(args, tmp_path, 180, env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "RuntimeError: boom" in out.stderr
    # The size measured before it is printed, the failed one is not.
    rows = [line.split()[0] for line in out.stdout.splitlines()[1:] if line[:9].strip().isdigit()]
    assert rows == ["1"], out.stdout
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("ignite-mgpu-scale-")]
    assert len(kept) == 1 and f"ignite-mgpu scale: stopped at 2; its files are in {kept[0]}" in out.stderr
    assert (kept[0] / "size-1" / "metrics.jsonl").is_file()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_measure_with_130_printing_the_sizes_measured_and_leaving_nothing(tmp_path):
    # Rank 1 of the 2-process size waits in forward for an hour; Ctrl-C reaches the whole process group, as a
    # terminal sends it.
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'faults'}",
        "FAULT": "sleep:1:3",
        "TMPDIR": str(tmp_path),
    }
    args = ["scale", *SMALL, "data.image_size=32", "model.name=faultmod:make", "--nproc", "2", "--iters", "4"]
    args.append("dist.stop_grace=3")  # the sleeping rank cannot stop itself: killed 3 s after the stop, not 60
    job = subprocess.Popen(
        [sys.executable, "-m", "ignite_mgpu", *args],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    said = []
    for line in job.stderr:
        said.append(line)
        if "ignite-mgpu scale: 2 processes" in line:
            break
    time.sleep(4)  # into rank 1's long forward
    os.killpg(job.pid, signal.SIGINT)
    out, err = job.communicate(timeout=90)
    assert job.returncode == 130, "".join(said) + err
    assert "ignite-mgpu scale: stopped at 2." in err and "Traceback" not in err
    rows = [line.split()[0] for line in out.splitlines()[1:] if line[:9].strip().isdigit()]
    assert rows == ["1"], out
    assert [p for p in tmp_path.iterdir() if p.name.startswith("ignite-mgpu-scale-")] == []


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--iters", "1"], {}, "--iters 1: measure at least 2 iterations at each size"),
        (["--gpus", "auto:1-2"], {}, "is a range that changes while a job runs; scale measures fixed sizes"),
        ([], {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "run it outside torchrun or srun"),
        (["data.batch_size=1"], {}, "data.batch_size"),
    ],
)
def test_requests_scale_cannot_measure_are_refused_before_anything_starts(args, env, said, tmp_path):
    out = run_cli(["scale", *SMALL, "--nproc", "2", *args], tmp_path, 60, {"TMPDIR": str(tmp_path), **env})
    assert out.returncode == 2, out.stderr[-2000:]
    assert said in out.stderr and "Traceback" not in out.stderr
    assert list(Path(tmp_path).iterdir()) == []
