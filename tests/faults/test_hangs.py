"""Hangs against the real CLI (docs/how-to/hangs.md): a rank stuck in its data loader, in a collective the other
rank never joins, or SIGSTOPped ends the job within the hang watch's window, with the stuck frame named and every
rank's stacks in hang_<time>.txt; a rank stuck in its first read is named before the first iteration (after
2 x dist.hang_seconds), or ends on dist.timeout with the watch off; a slow but live rank, a long evaluation and a
first step slow on every rank are not reported (the slow rank is named at the run's end, with its data as the cause);
`ignite-mgpu stacks` prints both ranks of a live job that goes on.
The window's floor is dist.hang_seconds=3 here (60 by default). Run: `python -m pytest tests/faults/test_hangs.py -q`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import cpu_only
from tests.faults.harness import REPO, Harness, Result
from tests.faults.test_faults import wait_until

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HANGS = [
    "train",
    "--nproc",
    "2",
    "--backend",
    "gloo",
    "model.name=faultmod:make8",
    "data.name=hangdata:images",
    "data.batch_size=64",
    "train.epochs=1",
    "train.check_every=1",
    "train.progress_bar=false",
    "checkpoint.every_iters=0",
    "dist.hang_seconds=3",
]


def hang_file(out: Path) -> str:
    files = list(out.glob("hang_*.txt"))
    assert len(files) == 1, sorted(p.name for p in out.iterdir())
    text = files[0].read_text()
    assert "=== rank 0 ===" in text and "=== rank 1 ===" in text, text
    return text


@pytest.mark.timeout(120)
def test_rank_stuck_in_its_data_loader_is_named(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*HANGS, "data.args={hang: '1:200'}", "--output-dir", str(out)], timeout=60)
    assert r.rc == 1, str(r)
    assert "the job hung: no rank made progress" in r.stderr, str(r)
    assert "rank(s) 1 stuck" in r.stderr, str(r)
    assert re.search(
        r"rank 1 \(pid \d+, last completed iteration 6\) is in \S*hangdata\.py:\d+ in __getitem__", r.stderr
    )
    assert re.search(r"rank 0 .* waits in backward", r.stderr), str(r)
    assert "__getitem__" in hang_file(out)
    assert r.stderr.count("the job hung") == 1, str(r)  # one report
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_rank_stuck_in_its_first_data_read_is_named_before_the_first_iteration(h: Harness) -> None:
    """Rank 1's first read (the model's example input) never returns; rank 0 built its model and waits in DDP's
    broadcast. Judged after 2 x dist.hang_seconds (6 s here; 120 s by default, tests/hangs/test_watch.py), not after
    torch's 30 minutes."""
    out = h.root / "out"
    r = h.run([*HANGS, "data.args={hang: '1:1'}", "--output-dir", str(out)], timeout=60)
    assert r.rc == 1, str(r)
    assert "the job hung before its first iteration: rank(s) 1 stayed behind the others" in r.stderr, str(r)
    assert re.search(
        r"rank 1 \(pid \d+, last completed iteration 0\) is in \S*hangdata\.py:\d+ in __getitem__", r.stderr
    ), str(r)
    assert "Where each rank was (rank(s) 1 stuck)" in r.stderr, str(r)
    assert re.search(r"rank 0 .* waits in DistributedDataParallel's construction", r.stderr), str(r)
    assert "__getitem__" in hang_file(out)
    assert r.elapsed < 45, str(r)  # 6 s after rank 0 built its model
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_first_step_hang_ends_on_dist_timeout_with_the_watch_off(h: Harness) -> None:
    """dist.timeout bounds the first step's collectives too (the job's group is made with it): with the watch off,
    rank 0's all-reduce gives up after 5 s and the report still names rank 1's line."""
    out = h.root / "out"
    args = [*HANGS, "dist.hang_seconds=0", "--timeout", "5", "data.args={hang: '1:1'}", "--output-dir", str(out)]
    r = h.run(args, timeout=60)
    assert r.rc == 1, str(r)
    assert re.search(r"rank 0 timed out after 5 s \(dist.timeout\).*rank\(s\) 1 stopped answering", r.stderr), str(r)
    assert re.search(r"rank 1 \(pid \d+\) is in \S*hangdata\.py:\d+ in __getitem__", r.stderr), str(r)
    hang_file(out)
    assert r.elapsed < 45, str(r)  # 5 s after rank 0 began to wait, not torch's 30 minutes
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_first_step_slow_on_every_rank_is_no_hang(h: Harness) -> None:
    """A long compilation, as every rank sees it: 8 s in the first forward on both ranks, longer than the first
    step's window (6 s) and than dist.timeout (6 s): the ranks wait for each other only as long as they differ."""
    out = h.root / "out"
    args = [*HANGS, "--timeout", "6", "--output-dir", str(out)]
    r = h.run(args, timeout=90, fault="pause:*:1:8")
    assert r.rc == 0, str(r)
    assert "hung" not in r.stderr and not list(out.glob("hang_*")), str(r)
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_every_rank_starved_of_data_is_judged_bound_by_data(h: Harness) -> None:
    """Both ranks read each item 2 ms late (32 items per process and step): no rank holds the other back, and the
    run ends saying that the job is bound by data."""
    out = h.root / "out"
    r = h.run([*HANGS, "data.args={slow: '*:0.002', val: 20}", "--output-dir", str(out)], timeout=90)
    assert r.rc == 0, str(r)
    said = [line for line in r.stderr.splitlines() if "step time:" in line]
    assert len(said) == 1 and "bound by data: the ranks wait" in said[0], str(r)
    (line,) = [json.loads(text) for text in (out / "metrics.jsonl").read_text().splitlines()]
    assert line["bound_by"] == "data" and min(line["time_data_ms"]) > 50, line


@pytest.mark.timeout(120)
def test_rank_stuck_in_a_collective_the_other_never_joins(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*HANGS, "data.args={collective: '1:200'}", "--output-dir", str(out)], timeout=60)
    assert r.rc == 1, str(r)
    assert re.search(
        r"rank 1 .* waits in the collective all_reduce, called at \S*hangdata\.py:\d+ in __getitem__", r.stderr
    )
    assert re.search(r"rank 0 .* waits in backward", r.stderr), str(r)
    hang_file(out)
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_ranks_in_different_collectives_are_named_within_seconds_not_a_window_later(h: Harness) -> None:
    # With the default hang window (60 s): rank 1 in an all-reduce that rank 0 never joins, rank 0 in backward's.
    out = h.root / "out"
    job = [arg for arg in HANGS if not arg.startswith("dist.hang_seconds")]
    r = h.run([*job, "data.args={collective: '1:200'}", "--output-dir", str(out)], timeout=60)
    assert r.rc == 1, str(r)
    assert "the ranks wait in different collectives after" in r.stderr and "their calls do not match" in r.stderr
    assert re.search(r"rank 1 .* waits in the collective all_reduce", r.stderr), str(r)
    assert r.elapsed < 45, str(r)  # PROBE_AFTER (5 s) after its last step, not dist.hang_seconds (60 s)
    hang_file(out)
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_sigstopped_rank_is_found_and_named(h: Harness) -> None:
    out = h.root / "out"
    # 100 iterations (6400 samples, 2 ms a sample read on rank 1): the job is still training when rank 1 is stopped.
    job = h.start([*HANGS, "data.args={slow: '1:0.002', n: 6400}", "--output-dir", str(out)])
    forward = job.pids_dir / "forward1"
    wait_until(lambda: forward.is_file() and len(forward.read_text().splitlines()) >= 2, job, 60, "rank 1 training")
    pid = int(forward.read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)
    r = job.wait(timeout=time.monotonic() - job.start + 40)  # within 40 s of the stop
    assert r.rc == 1, str(r)
    assert re.search(rf"rank 1 \(pid {pid}, .*\(process {pid} was stopped \(SIGSTOP, state T\)\)", r.stderr), str(r)
    assert "File " in hang_file(out).split("=== rank 1 ===")[1]  # it answered once continued
    h.assert_no_leftovers()


def stacks(target: str) -> subprocess.CompletedProcess:
    """`ignite-mgpu stacks TARGET` (a run folder or a launcher's pid), as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "ignite_mgpu", "stacks", target]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Live:
    """The live job's result, its run folder and what `ignite-mgpu stacks` printed of it (by folder, by pid)."""

    result: Result
    out: Path
    shown: list[subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Live:
    """One job that goes on to its end, shared by the tests that read it: rank 1 reads 16x slower than rank 0, the
    evaluation (10 s) lasts longer than the window (3 s), and `ignite-mgpu stacks` is asked for both ranks by the
    run folder and by the launcher's pid once rank 1 trains. Nothing of it may outlive it."""
    root = tmp_path_factory.mktemp("live")
    harness, out = Harness(root), root / "out"
    try:
        with cpu_only(root / "claims"):
            data = "data.args={slow: '1:0.005', val_slow: 0.02, val: 1000}"
            job = harness.start([*HANGS, data, "--output-dir", str(out)])
            forward = job.pids_dir / "forward1"
            wait_until(lambda: forward.is_file() and len(forward.read_text().splitlines()) >= 2, job, 60, "training")
            shown = [stacks(target) for target in (str(out), str(job.pid))]
            r = job.wait(timeout=120)
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    return Live(r, out, shown)


@pytest.mark.timeout(150)
def test_slow_live_rank_and_long_evaluation_are_not_reported(live: Live) -> None:
    """Rank 1 reads 16x slower than rank 0; the evaluation (10 s) lasts longer than the window (3 s)."""
    assert live.result.rc == 0, str(live.result)
    assert "hung" not in live.result.stderr and not list(live.out.glob("hang_*")), str(live.result)


@pytest.mark.timeout(150)
def test_the_slow_rank_is_named_with_its_cause_at_the_end(live: Live) -> None:
    """Rank 1 reads 16x slower than rank 0: the run ends saying so, and rank 0 waits for it in the all-reduce."""
    said = [line for line in live.result.stderr.splitlines() if "step time:" in line]
    assert len(said) == 1, str(live.result)
    assert re.search(r"rank 1 is the slowest: it waits \d+% of its steps for data \(raise data.num_workers", said[0])
    assert "the other ranks wait for it in the all-reduce" in said[0], said[0]
    (line,) = [json.loads(text) for text in (live.out / "metrics.jsonl").read_text().splitlines()]
    assert line["slowest_rank"] == 1 and line["bound_by"] == "slowest_rank", line
    assert line["time_data_ms"][1] > 10 * line["time_data_ms"][0] and line["time_comm_ms"][0] > line["time_comm_ms"][1]


@pytest.mark.timeout(150)
def test_stacks_prints_both_ranks_of_a_live_job(live: Live) -> None:
    for shown in live.shown:  # by the run folder, by the launcher's pid
        assert shown.returncode == 0, shown.stderr
        assert "=== rank 0 ===" in shown.stdout and "=== rank 1 ===" in shown.stdout, shown.stdout
        assert shown.stdout.count("in worker_main") == 2, shown.stdout
    assert live.result.rc == 0, str(live.result)  # the job went on to its end


@pytest.mark.timeout(150)
def test_stacks_of_a_script_under_run(h: Harness) -> None:
    job = h.start(["run", "--nproc", "2", str(Path(__file__).parent / "live_script.py"), "40"])
    deadline = time.monotonic() + 60
    while True:  # until both ranks are in the script's loop
        shown = stacks(str(job.pid))
        if shown.stdout.count("in reduce_for") == 2 or time.monotonic() > deadline or not job.running():
            break
        time.sleep(1)
    assert shown.returncode == 0 and shown.stdout.count("in reduce_for") == 2, shown.stdout + shown.stderr
    job.kill_all()
