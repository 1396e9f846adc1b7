"""Elastic jobs on the 4-GPU stand-in nvidia-smi with gloo workers on the CPU; a job on ``--gpus auto:2-4`` takes
the 4 GPUs, and every job ends within 1e-5 of an uninterrupted 4-process run (the tolerance of
test_any_process_count.py), its changes recorded in metrics.jsonl and the goodput.

- Leaving out a failed GPU (processes/elastic.py): in epoch 2 one rank's GPU fails (it leaves nvidia-smi's table and
  the rank is killed, or the rank raises a CUDA device error); the job restarts on the other 3 from the newest
  checkpoint, lets go of the failed GPU's claim and says so in one line.
- Lending (processes/elastic.py): a real job waiting in line for 2 GPUs gets GPU 2,3 from the running job, which goes
  on with 2 processes, `devices` showing what it lent; when the waiter ends, the job takes them back. Each epoch's
  train_loss is the uninterrupted run's, though both epochs ran on 4 and on 2 processes.
- A range cut to what its data splits over: auto:2-4 with a global batch of 3 takes back one GPU, not two, and ends.
`python -m pytest tests/distributed/test_elastic.py`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ignite_mgpu.checkpoint.files import read_checkpoint
from ignite_mgpu.gpus.devices import format_devices, who_has
from ignite_mgpu.gpus.inventory import query_gpus
from tests.conftest import REPO, cpu_only, needs_gpus, run_cli, run_in_session
from tests.gpus.test_claims import TABLE, Job, claimed, fake_gpus  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUNNER = Path(__file__).with_name("fake_cuda_cli.py")
FAULTS = REPO / "tests" / "faults"
# faultmod's linear model (no random, no batch-dependent layer) on 320 images in global batches of 64: 5 iterations an
# epoch, 2 epochs, a checkpoint every 3 iterations (all kept); the fault fires at iteration 8, after checkpoint_6.
ARGS = [
    "--backend",
    "gloo",
    "model.name=faultmod:make",
    "data.train_size=320",
    "data.val_size=50",
    "data.batch_size=64",
    "train.epochs=2",
    "train.check_every=1",
    "train.progress_bar=false",
    "checkpoint.every_iters=3",
    "checkpoint.n_saved=10",
]


def job_env(tmp_path: Path, fault: str = "") -> dict[str, str]:
    paths = [str(FAULTS), str(REPO)]
    return {"PYTHONPATH": os.pathsep.join(paths), "FAULT": fault, "PIDS_DIR": str(tmp_path / "pids"),
            "OMP_NUM_THREADS": "1"}  # fmt: skip


def weights(out: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(out / "checkpoint_10.pt")["model"]


def assert_the_same_run(out: Path, reference: Path) -> None:
    """The run ended within 1e-5 of the uninterrupted one, and let go of every claim."""
    want = weights(reference)
    for key, value in weights(out).items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=1e-5, msg=key)
    assert claimed() == {}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted 4-process run."""
    root = tmp_path_factory.mktemp("reference")
    with cpu_only(root / "claims"):
        out = root / "out"
        result = run_cli(["train", *ARGS, "--nproc", "4", "--output-dir", str(out)], root, 240, job_env(root))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "fault, reason",
    [
        ("once-losegpu:2:8", r"nvidia-smi no longer lists it"),
        ("once-deverror:2:8", r"rank 2's error is a CUDA device error \('unspecified launch failure'\)"),
    ],
)
def test_a_failed_gpu_is_left_out_and_the_same_run_ends_on_three(fake_gpus, reference, tmp_path, fault, reason):  # noqa: F811
    (fake_gpus / "gpus.csv").write_text(TABLE.replace("71680", "1").replace("40960", "1"))  # 4 idle GPUs
    (fake_gpus / "apps.csv").write_text("")
    out = tmp_path / "elastic"
    command = [sys.executable, str(RUNNER), "train", *ARGS, "--gpus", "auto:2-4", "--max-restarts", "1"]
    env = {**os.environ, **job_env(tmp_path, fault)}
    result = run_in_session([*command, "--output-dir", str(out)], 300, tmp_path, env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--gpus auto:2-4 chose GPU 0 " in result.stderr and "world size 4" in result.stderr
    line = (
        rf"ignite-mgpu: left out GPU 2 \({reason}\); its claim is released, and the restart continues on GPU "
        r"0,1,3 \(3 processes, was 4; --gpus auto:2-4\)\.\n"
    )
    assert len(re.findall(line, result.stderr)) == 1, result.stderr[-4000:]
    assert "resuming from" in result.stderr and "checkpoint_6.pt at iteration 6" in result.stderr
    if "losegpu" in fault:  # it aborted in C++ after the watchdog's lines: no failure file, its output names it
        assert "rank 2 died (SIGABRT, no Python clean-up) after writing: CUDA error: unknown error" in result.stderr
    lines = metrics(out)
    assert [(r["epoch"], r["processes"], r["restarts"]) for r in lines] == [(1, 4, 0), (2, 3, 1)]
    assert lines[1]["time_resize_s"] > 0 and lines[1]["time_restart_s"] == 0 and lines[0]["time_resize_s"] == 0
    assert_the_same_run(out, reference)


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_on_real_gpus_a_rank_with_a_device_error_is_left_out(tmp_path, monkeypatch):
    """The twin on a machine with 2 GPUs or more: nccl, the real nvidia-smi, rank 1 raising a CUDA device error."""
    needs_gpus(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = tmp_path / "elastic"
    args = [a for a in ARGS if a not in ("--backend", "gloo")]
    result = run_cli(["train", *args, "--gpus", "auto:1-2", "--max-restarts", "1", "--output-dir", str(out)],
                     tmp_path, 300, job_env(tmp_path, "once-deverror:1:8"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"left out GPU \d+ \(rank 1's error is a CUDA device error", result.stderr), result.stderr
    assert [r["processes"] for r in metrics(out)] == [2, 1]


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_on_a_real_gpu_a_healthy_gpu_stays_and_one_with_a_device_error_is_never_below_min(tmp_path, monkeypatch):
    """The twin on one GPU: the real nvidia-smi/NVML finds the job's GPU again by its UUID after a rank's SIGKILL
    (a plain restart on it), and a device error on the only GPU of auto:1-1 ends the job instead of going below MIN."""
    needs_gpus(1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = [a for a in ARGS if a not in ("--backend", "gloo")]
    kept = tmp_path / "kept"
    result = run_cli(["train", *args, "--gpus", "auto:1-1", "--max-restarts", "1", "--output-dir", str(kept)],
                     tmp_path, 300, job_env(tmp_path, "once-kill:0:8"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "left out" not in result.stderr and "restart 1 of 1" in result.stderr
    assert [r["processes"] for r in metrics(kept)] == [1, 1] and metrics(kept)[1]["time_resize_s"] == 0
    failed = tmp_path / "failed"
    result = run_cli(["train", *args, "--gpus", "auto:1-1", "--max-restarts", "1", "--output-dir", str(failed)],
                     tmp_path, 300, job_env(tmp_path / "second", "once-deverror:0:8"))  # fmt: skip
    assert result.returncode == 1, result.stderr[-4000:]
    assert re.search(
        r"not restarted: GPU \d+ \(rank 0's error is a CUDA device error \('unspecified launch failure'\)\) "
        r"failed, leaving 0 GPUs, below the range's MIN 1 \(--gpus auto:1-1\)",
        result.stderr,
    ), result.stderr


def _wait_for(what, timeout: float, job: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert job.poll() is None, f"the elastic job ended ({job.returncode}):\n{log.read_text()[-4000:]}"
        assert time.monotonic() < end, f"not within {timeout} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


@pytest.mark.timeout(400)
def test_a_job_on_a_range_lends_two_gpus_to_a_waiting_job_and_takes_them_back(fake_gpus, reference, tmp_path):  # noqa: F811
    (fake_gpus / "gpus.csv").write_text(TABLE.replace("71680", "1").replace("40960", "1"))  # 4 idle GPUs
    (fake_gpus / "apps.csv").write_text("")
    out, log = tmp_path / "elastic", tmp_path / "elastic.log"
    env = {**os.environ, **job_env(tmp_path, "slow:*:1:1")}  # 1 s an iteration: room for both changes
    command = [sys.executable, str(RUNNER), "train", *ARGS, "--gpus", "auto:2-4", "--output-dir", str(out)]
    with log.open("w") as stderr:
        job = subprocess.Popen(command, env=env, stderr=stderr, stdout=subprocess.DEVNULL, start_new_session=True)
    waiter = None
    try:
        _wait_for(lambda: (tmp_path / "pids" / "forward3").exists(), 150, job, log)  # training on 4
        waiter = Job("--gpus", "auto:2", "--wait", "120", "--hold", "--poll", "0.1")
        asked = time.monotonic()
        got = waiter.line(timeout=60)
        assert got.get("gpus") == [2, 3] and time.monotonic() - asked < 60, got
        snapshot = query_gpus()
        shown = format_devices(snapshot, os.environ, claims=who_has(snapshot, os.environ))
        assert re.search(
            r"Elastic job of \S+ \(pid \d+\): --gpus auto:2-4, holds GPU 0,1 \(2 of 2-4\); lent GPU 2,3 to jobs "
            r"that waited in line\.",
            shown,
        ), shown
        # The waiter holds GPU 2,3 until an epoch ended on 2 processes.
        _wait_for(lambda: (out / "metrics.jsonl").exists() and metrics(out)[-1]["processes"] == 2, 150, job, log)
        waiter.release()
        assert job.wait(200) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        if waiter is not None:
            waiter.kill()
    stderr = log.read_text()
    lent = re.findall(
        r"ignite-mgpu: lent GPU 2,3 to \S+ \(pid \d+, `claimer.py --gpus auto:2 --wait [^`]*`, since [^)]*\), waiting "
        r"in line: the job goes on with 2 processes on GPU 0,1 \(was 4; --gpus auto:2-4\), resuming from \S+"
        r"checkpoint_(\d+)\.pt at iteration \1\.\n",
        stderr,
    )
    assert len(lent) == 1, stderr[-4000:]
    taken = re.findall(
        r"ignite-mgpu: took GPU 2,3, free and waited for by nobody: the job goes on with 4 processes on GPU 0-3 "
        r"\(was 2; --gpus auto:2-4\), resuming from \S+checkpoint_(\d+)\.pt at iteration \1\.\n",
        stderr,
    )
    assert len(taken) == 1 and int(taken[0]) > int(lent[0]), stderr[-4000:]
    assert "restart" not in stderr.replace("restarts", ""), stderr[-4000:]  # a change of size is not a restart
    lines = metrics(out)
    assert [(r["epoch"], r["processes"], r["restarts"]) for r in lines] == [(1, 2, 0), (2, 4, 0)], lines
    assert all(r["time_resize_s"] > 0 and r["time_restart_s"] == 0 for r in lines), lines
    # Each epoch ran on 4 and on 2 processes: its train_loss is still the mean over its samples.
    want = [r["train_loss"] for r in metrics(reference)]
    assert [r["train_loss"] for r in lines] == pytest.approx(want, abs=1e-4), (lines, want)
    assert_the_same_run(out, reference)


@pytest.mark.timeout(300)
def test_a_range_whose_batch_splits_over_fewer_than_max_takes_back_only_what_it_can_use(fake_gpus, tmp_path):  # noqa: F811
    """auto:2-4 with a global batch of 3, started on 2 GPUs (GPU 0,1 busy): when they free up it took both and died
    (data.batch_size=3 over 4 processes, exit 1). Now its range is auto:2-3 from the start: it takes one, ends 0."""
    out, log = tmp_path / "elastic", tmp_path / "elastic.log"
    args = [a for a in ARGS if not a.startswith(("data.batch_size", "data.train_size", "checkpoint."))]
    args += ["data.batch_size=3", "data.train_size=60", "checkpoint.every_iters=5"]
    env = {**os.environ, **job_env(tmp_path, "slow:*:1:0.2")}
    command = [sys.executable, str(RUNNER), "train", *args, "--gpus", "auto:2-4", "--output-dir", str(out)]
    with log.open("w") as stderr:
        job = subprocess.Popen(command, env=env, stderr=stderr, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(lambda: (tmp_path / "pids" / "forward1").exists(), 150, job, log)  # training on GPU 2,3
        (fake_gpus / "gpus.csv").write_text(TABLE.replace("71680", "1").replace("40960", "1"))  # 0,1 free now
        (fake_gpus / "apps.csv").write_text("")
        assert job.wait(200) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    stderr = log.read_text()
    assert "ignite-mgpu: --gpus auto:2-4 takes at most 3 GPUs (auto:2-3), now and when more free up: " in stderr
    assert re.search(r"took GPU 0, free and waited for by nobody: the job goes on with 3 processes on GPU 0,2,3 "
                     r"\(was 2; --gpus auto:2-3\)", stderr), stderr[-4000:]  # fmt: skip
    assert "ConfigError" not in stderr and [r["processes"] for r in metrics(out)][-1] == 3
    assert claimed() == {}


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_on_real_gpus_a_job_on_a_range_lends_one_to_a_waiting_job_and_takes_it_back(tmp_path, monkeypatch):
    """The twin on a machine with 2 GPUs or more: nccl, the real nvidia-smi, the real CLI (a look every 5 s)."""
    needs_gpus(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out, log = tmp_path / "elastic", tmp_path / "elastic.log"
    # 3 epochs of 2 s steps: room for a look every 5 s, twice before taking the GPU back.
    args = [a if a != "train.epochs=2" else "train.epochs=3" for a in ARGS if a not in ("--backend", "gloo")]
    env = {**os.environ, "PYTHONPATH": str(REPO), **job_env(tmp_path, "slow:*:1:2")}  # 2 s a step: room to lend
    command = [sys.executable, "-m", "ignite_mgpu", "train", *args, "--gpus", "auto:1-2", "--output-dir", str(out)]
    with log.open("w") as stderr:
        job = subprocess.Popen(command, env=env, stderr=stderr, stdout=subprocess.DEVNULL, start_new_session=True)
    waiter = None
    try:
        _wait_for(lambda: (tmp_path / "pids" / "forward1").exists(), 150, job, log)
        waiter = Job("--gpus", "auto:1", "--wait", "120", "--hold")
        assert len(waiter.line(timeout=60).get("gpus", [])) == 1
        _wait_for(lambda: (out / "metrics.jsonl").exists(), 150, job, log)
        waiter.release()
        assert job.wait(300) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        if waiter is not None:
            waiter.kill()
    stderr = log.read_text()
    assert re.search(r"lent GPU \d+ to .* the job goes on with 1 process on GPU \d+ \(was 2", stderr), stderr
    assert re.search(r"took GPU \d+, free and waited for by nobody: the job goes on with 2 processes", stderr), stderr
    processes = [r["processes"] for r in metrics(out)]
    assert processes[0] == 1 and processes[-1] == 2, processes
