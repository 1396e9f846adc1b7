"""A job that heals itself (issue #14): ``--max-restarts`` after a killed, failed or hung rank, resuming from the
newest complete checkpoint with weights bitwise identical to an uninterrupted run; the same ``--resume auto``
command restarted by torchrun; SLURM pre-emption (a stand-in ``scontrol`` on PATH) and the requeued job.

Every job is the real CLI on 2 gloo processes with the fault model of faultmod.py (``once-`` faults fire in the
first attempt only), and nothing of it may outlive it. Run: `python -m pytest tests/faults/test_restarts.py -q`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import cpu_only
from tests.faults.harness import Harness, Result
from tests.faults.test_faults import BASE, assert_last_good, checkpoints, wait_until

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 10 iterations per epoch, a check every iteration, a checkpoint every 4 iterations and at each epoch's end;
# deterministic, with a constant learning rate so that a 1-epoch run equals the first epoch of a 2-epoch one.
EXACT = [
    *BASE,
    "train.deterministic=true",
    "optim.scheduler=constant",
    "checkpoint.every_iters=4",
]


def final_state(path: Path) -> dict:
    from ignite_mgpu.checkpoint.files import read_checkpoint

    ckpt = read_checkpoint(path)
    return {"model": ckpt["model"], "optimizer": ckpt["optimizer"]["state"], "trainer": ckpt["trainer"]["iteration"]}


def assert_bitwise_equal(a: Path, b: Path) -> None:
    sa, sb = final_state(a), final_state(b)
    assert sa["trainer"] == sb["trainer"]
    for key, value in sa["model"].items():
        assert torch.equal(value, sb["model"][key]), f"{key} differs between {a} and {b}"
    for k, v in sa["optimizer"].items():
        assert torch.equal(v["momentum_buffer"], sb["optimizer"][k]["momentum_buffer"]), k


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_goodput_adds_up(out: Path) -> dict:
    """The measured parts (all but "other") cover the run's wall time within 3 %; the epochs' lines add up to
    the run's totals up to the last line. Returns the run's totals (goodput.json)."""
    from ignite_mgpu.runs.goodput_parts import FIELDS, MEASURED, read_totals

    epochs = lines(out)
    totals = read_totals(out, [])
    wall = totals["time_wall_s"]
    assert sum(totals[FIELDS[p]] for p in MEASURED) >= 0.97 * wall, totals
    assert sum(r["time_wall_s"] for r in epochs) == pytest.approx(epochs[-1]["run_time_s"], abs=0.01)
    assert epochs[-1]["run_time_s"] <= wall
    # goodput is rounded to 4 decimals, the seconds to 3: a short run's train time alone can be 1 % off then
    assert totals["goodput"] == pytest.approx(totals["time_train_s"] / wall, abs=0.0005 / wall + 0.00005)
    for r in epochs:
        assert sum(r[FIELDS[p]] for p in FIELDS) == pytest.approx(r["time_wall_s"], abs=0.01)
    return totals


def test_goodput_of_a_clean_run_adds_up_to_its_wall_time(reference: Path) -> None:
    """The uninterrupted job: start-up, training, data wait, validation and checkpoint stalls were all seen, no
    restart; the run's wall time (the command's start to the end of training) is most of the command's lifetime
    (the workers' exit after it is not counted: seconds on a loaded machine)."""
    totals = assert_goodput_adds_up(reference)
    elapsed = float((reference.parent / "elapsed_s").read_text())
    assert 0.8 * elapsed <= totals["time_wall_s"] <= elapsed, (elapsed, totals)
    for part in ("startup", "train", "data_wait", "eval", "checkpoint"):
        assert totals[f"time_{part}_s"] > 0, (part, totals)
    assert totals["time_restart_s"] == totals["time_lost_s"] == totals["redone_iterations"] == 0
    assert [r["time_startup_s"] > 0 for r in lines(reference)] == [True, False]
    # Without the start-up, which dominates a job this short: epoch 2's measured parts still cover most of it.
    second = lines(reference)[1]
    assert second["time_wall_s"] - second["time_other_s"] >= 0.8 * second["time_wall_s"], second


def rows(out: Path) -> list[tuple[int, int]]:
    """(epoch, restarts) of every line of metrics.jsonl."""
    return [(r["epoch"], r["restarts"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job: 2 epochs, every checkpoint kept (iterations 4, 8, 10, 12, 16, 20)."""
    root = tmp_path_factory.mktemp("reference")
    harness = Harness(root)
    out = root / "out"
    try:
        result = harness.run([*EXACT, "train.epochs=2", "checkpoint.n_saved=10", "--output-dir", str(out)], 120)
        assert result.rc == 0, result
    finally:
        harness.cleanup()
    (root / "elapsed_s").write_text(str(result.elapsed))  # the command's wall time, for the goodput test
    assert sorted(checkpoints(out)) == [4, 8, 10, 12, 16, 20]
    return out


# What differs between two runs of the same deterministic job: times, speeds, memory, what is judged from them (the
# slowest rank, the bound: runs/bottleneck.py), and the healing's own counts.
NOT_COMPARED = re.compile(r"(_s$|time|goodput|share|per_s|ms|mb|memory|peak|restarts|redone|slowest_rank|bound_by)")


def assert_same_numbers(healed: list[dict], uninterrupted: list[dict]) -> None:
    """Every number of metrics.jsonl that is not a time (nor the healing's count) is equal, line by line."""
    assert len(healed) == len(uninterrupted)
    for a, b in zip(healed, uninterrupted, strict=True):
        compared = sorted(k for k in b if not NOT_COMPARED.search(k))
        assert "train_loss" in compared and "val_loss" in compared
        assert {k: a.get(k) for k in compared} == {k: b[k] for k in compared}


def restart_line(r: Result) -> str:
    lines = [ln for ln in r.stderr.splitlines() if re.match(r"ignite-mgpu: restart \d of", ln)]
    assert len(lines) == 1, r  # each restart logged once
    return lines[0]


@pytest.mark.timeout(240)
def test_a_sigkilled_rank_heals_bitwise_identical(h: Harness, reference: Path) -> None:
    """Rank 1 is SIGKILLed in iteration 15 (mid-epoch 2, after checkpoint_12): the job restarts once from it and
    ends with weights bitwise identical to the job never interrupted."""
    out = h.root / "out"
    r = h.run([*EXACT, "train.epochs=2", "--max-restarts", "1", "--output-dir", str(out)], 150, "once-kill:1:15")
    assert r.rc == 0, str(r)
    assert r.stderr.count("rank 1 terminated with signal SIGKILL") == 1, str(r)
    assert restart_line(r) == (
        "ignite-mgpu: restart 1 of 1 (dist.max_restarts) after rank 1 failed, at once (one rank died): resuming from "
        f"{out / 'checkpoint_12.pt'} at iteration 12; 2 iteration(s) lost (every rank had completed iteration 14)."
    )
    assert re.search(r"resumed from \S*checkpoint_12\.pt at iteration 12", r.stderr), str(r)
    h.assert_no_leftovers()
    assert_bitwise_equal(out / "checkpoint_20.pt", reference / "checkpoint_20.pt")
    assert rows(out) == [(1, 0), (2, 1)]  # one row per epoch; epoch 2 was trained after the restart
    # Epoch 2's train_loss covers the whole epoch (its sums carried by checkpoint_12), as the uninterrupted run's.
    assert_same_numbers(lines(out), lines(reference))
    # Goodput: the restart's time and the 2 iterations it re-did (13 and 14) are in epoch 2's line.
    totals, second = assert_goodput_adds_up(out), lines(out)[1]
    assert second["redone_iterations"] == totals["redone_iterations"] == 2
    assert second["time_restart_s"] > 0 and second["time_lost_s"] > 0 and second["time_startup_s"] == 0


@pytest.mark.timeout(180)
def test_a_kill_before_the_first_checkpoint_restarts_from_the_beginning(h: Harness, reference: Path) -> None:
    out = h.root / "out"
    r = h.run([*EXACT, "--max-restarts", "1", "--output-dir", str(out)], 120, "once-kill:1:3")
    assert r.rc == 0, str(r)
    assert restart_line(r) == (
        "ignite-mgpu: restart 1 of 1 (dist.max_restarts) after rank 1 failed, at once (one rank died): from the "
        "beginning (no complete checkpoint yet); 2 iteration(s) lost (every rank had completed iteration 2)."
    )
    assert "--resume auto: no complete checkpoint in" in r.stderr and "starting a new run" in r.stderr, str(r)
    h.assert_no_leftovers()
    assert_bitwise_equal(out / "checkpoint_10.pt", reference / "checkpoint_10.pt")
    assert rows(out) == [(1, 1)]
    # The failed attempt's start-up is kept; its two iterations were re-done.
    (first,) = lines(out)
    assert first["redone_iterations"] == 2 and first["time_startup_s"] > 0 and first["time_restart_s"] > 0
    assert_goodput_adds_up(out)


@pytest.mark.timeout(180)
def test_when_the_restarts_run_out_every_failure_is_reported_and_the_job_exits_1(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*EXACT, "--max-restarts", "1", "--output-dir", str(out)], 120, "kill:1:5")  # in every attempt
    assert r.rc == 1, str(r)
    assert r.stderr.count("rank 1 terminated with signal SIGKILL") == 2, r  # each failure, once
    assert "resuming from" in restart_line(r) and "checkpoint_4.pt at iteration 4" in restart_line(r), str(r)
    assert r.stderr.rstrip().endswith("ignite-mgpu: gave up after 1 restart(s) (dist.max_restarts=1)."), str(r)
    assert len(h.jobs[0].recorded_pids()) == 4  # two ranks, started twice
    h.assert_no_leftovers()
    assert_last_good(out, 8)  # the second attempt resumed from 4, saved 8 and was killed in iteration 9


@pytest.mark.timeout(120)
def test_a_user_error_is_not_restarted(h: Harness) -> None:
    """A full disk (the first checkpoint cannot be written) would fail again: no restart, exit 1 at once."""
    out = h.root / "out"
    r = h.run([*EXACT, "--max-restarts", "2", "--output-dir", str(out)], 60, "nospace:0:1")
    assert r.rc == 1, str(r)
    assert "rank 0 failed with CheckpointError: saving checkpoint_4.pt failed" in r.stderr, str(r)
    assert "No space left on device" in r.stderr, str(r)
    assert "restart 1 of" not in r.stderr, str(r)
    assert r.stderr.rstrip().endswith(
        "ignite-mgpu: not restarted: CheckpointError is an error in the configuration, the data or a checkpoint, "
        "which a restart would meet again (dist.max_restarts=2)."
    ), str(r)
    assert len(h.jobs[0].recorded_pids()) == 2  # one attempt
    h.assert_no_leftovers()


@pytest.mark.timeout(180)
def test_a_hung_rank_hits_the_collective_timeout_then_the_job_restarts(h: Harness) -> None:
    out = h.root / "out"
    args = [*EXACT, "--max-restarts", "1", "--timeout", "5", "--output-dir", str(out)]
    r = h.run(args, 150, "once-sleep:1:6")  # rank 1 hangs in iteration 6; rank 0 waits in its all-reduce
    assert r.rc == 0, str(r)
    assert re.search(r"rank 0 timed out after 5 s \(dist.timeout\).*rank\(s\) 1 stopped answering", r.stderr), str(r)
    assert restart_line(r).endswith(
        f"resuming from {out / 'checkpoint_4.pt'} at iteration 4; 1 iteration(s) lost (every rank had completed "
        "iteration 5)."
    ), str(r)
    h.assert_no_leftovers()
    assert_last_good(out, 10)
    assert rows(out) == [(1, 1)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_torchrun_restarts_the_same_resume_auto_command(h: Harness, reference: Path) -> None:
    """`torchrun --max-restarts 1 ... train --resume auto`: the first start has no checkpoint (a new run), rank 1 is
    killed in iteration 6, torchrun starts both processes again and the same command resumes checkpoint_4."""
    out = h.root / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1"]
    torchrun += ["--master_port", str(free_port()), "-m", "ignite_mgpu"]
    args = ["train", "--backend", "gloo", *EXACT[5:], "--resume", "auto", "--output-dir", str(out)]
    r = h.run(args, 180, "once-kill:1:6", command=torchrun)
    assert r.rc == 0, str(r)
    assert "--resume auto: no complete checkpoint in" in r.stderr, r  # the first start
    assert re.search(r"resumed from \S*checkpoint_4\.pt at iteration 4", r.stderr), r  # the restart
    h.assert_no_leftovers()
    assert_bitwise_equal(out / "checkpoint_10.pt", reference / "checkpoint_10.pt")
    assert rows(out) == [(1, 1)]  # TORCHELASTIC_RESTART_COUNT


def preempted(h: Harness, out: Path, log: Path) -> tuple[list[str], dict[str, str], Result]:
    """A 2-epoch EXACT job in a single-task SLURM job (a stand-in `scontrol` that logs to ``log``), pre-empted with
    SIGUSR1 to every process of the step once checkpoint_4 exists: its args, its SLURM environment, its result."""
    bin_dir = h.root / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    (bin_dir / "scontrol").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SCONTROL_LOG": str(log)}
    slurm["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    args = [*EXACT, "train.epochs=2", "--resume", "auto", "--output-dir", str(out)]
    job = h.start(args, "slow:*:1:0.2", extra=slurm)
    wait_until(lambda: (out / "checkpoint_4.pt").exists(), job, 90, "the first checkpoint")
    for pid in [job.pid, *job.recorded_pids()]:
        os.kill(pid, signal.SIGUSR1)
    r = job.wait(60)
    assert r.rc == 138, str(r)
    return args, slurm, r


@dataclass(frozen=True)
class Preemption:
    """The pre-empted job of ``preempted()``, run once for the tests of its requeue: its args, its SLURM environment,
    its result, its run folder (read-only: each test requeues a copy) and its scontrol log."""

    args: list[str]
    slurm: dict[str, str]
    result: Result
    out: Path
    log: Path

    def copy(self, root: Path) -> tuple[list[str], dict[str, str], Path, Path]:
        """The run folder and scontrol log copied into ``root``: the requeued job's args and environment pointing
        at them, the copies."""
        out, log = root / "out", root / "scontrol.log"
        shutil.copytree(self.out, out)  # its lock file too, as a requeued job finds it
        shutil.copyfile(self.log, log)
        args = [str(out) if a == str(self.out) else a for a in self.args]
        return args, {**self.slurm, "SCONTROL_LOG": str(log)}, out, log


@pytest.fixture(scope="module")
def preemption(tmp_path_factory: pytest.TempPathFactory) -> Preemption:
    """One pre-empted job shared by the two requeue tests (the same command, requeued on 2 and on 3 processes)."""
    root = tmp_path_factory.mktemp("preempted")
    harness = Harness(root)
    try:
        with cpu_only(root / "claims"):
            args, slurm, r = preempted(harness, root / "out", root / "scontrol.log")
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    return Preemption(args, slurm, r, root / "out", root / "scontrol.log")


@pytest.mark.timeout(240)
def test_slurm_preemption_checkpoints_requeues_and_the_requeued_job_resumes(h: Harness, preemption: Preemption) -> None:
    """A single-task SLURM job with 2 processes gets SIGUSR1 (sbatch --signal=USR1@90; SLURM signals every process
    of the step): every rank stops at one iteration, writes a checkpoint, the job runs `scontrol requeue` and
    exits 138. The requeued job, the same command, resumes from that checkpoint."""
    r = preemption.result
    assert "ignite-mgpu: SIGUSR1 received (pre-emption): every rank stops and writes a checkpoint" in r.stderr, str(r)
    m = re.search(r"stopped by SIGUSR1 at iteration (\d+)", r.stderr)
    assert m and 4 <= int(m.group(1)) < 20, str(r)
    stopped_at = int(m.group(1))
    assert "ignite-mgpu: requeued SLURM job 4242 (scontrol requeue 4242)" in r.stderr, str(r)
    assert preemption.log.read_text() == "requeue 4242\n"  # once per job
    assert_last_good(preemption.out, stopped_at)

    args, slurm, out, log = preemption.copy(h.root)
    r = h.run(args, 120, None, tag="b", extra={**slurm, "SLURM_RESTART_COUNT": "1"})  # the requeued job
    assert r.rc == 0, str(r)
    assert re.search(rf"resumed from \S*checkpoint_{stopped_at}\.pt at iteration {stopped_at}", r.stderr), str(r)
    assert log.read_text() == "requeue 4242\n"
    assert rows(out) == [(1, 1 if stopped_at < 10 else 0), (2, 1)]  # SLURM_RESTART_COUNT
    h.assert_no_leftovers()


@pytest.mark.timeout(240)
def test_a_preempted_job_requeued_on_three_processes_is_the_same_run(
    h: Harness, reference: Path, preemption: Preemption
) -> None:
    """A SLURM pre-emption at any iteration (the stop's checkpoint is as unplanned as a time-based one), and the
    requeued job gets 3 processes, not 2: it resumes at the stop and ends within 1e-5 of the uninterrupted run."""
    r = preemption.result
    stopped_at = int(re.search(r"stopped by SIGUSR1 at iteration (\d+)", r.stderr).group(1))  # type: ignore[union-attr]
    args, slurm, out, _ = preemption.copy(h.root)
    on_three = [a if a != "2" or args[i - 1] != "--nproc" else "3" for i, a in enumerate(args)]
    r = h.run(on_three, 120, None, tag="b", extra={**slurm, "SLURM_RESTART_COUNT": "1"})
    assert r.rc == 0, str(r)
    assert re.search(rf"resumed from \S*checkpoint_{stopped_at}\.pt at iteration {stopped_at}", r.stderr), str(r)
    want, got = final_state(reference / "checkpoint_20.pt"), final_state(out / "checkpoint_20.pt")
    assert got["trainer"] == want["trainer"] == 20
    for key, value in want["model"].items():
        torch.testing.assert_close(got["model"][key], value, rtol=0, atol=1e-5, msg=key)
    h.assert_no_leftovers()
