"""Fault injection against the real CLI: the failure scenarios S1-S30 (tests/faults/SCENARIOS.md).

Every test runs ``python -m ignite_mgpu train`` in a subprocess (its own session, a hard timeout, its own
``tmp_path``) with the test-only model ``faultmod:make`` (tests/faults/faultmod.py), which raises, hangs, kills
itself, returns NaN or slows down at a chosen rank and iteration. The harness (tests/faults/harness.py) records
each job's process tree and, on request, its LISTEN sockets; after the job every recorded process must be gone.
Scenario ids (S1...) refer to SCENARIOS.md beside this file. Run: `python -m pytest tests/faults -q`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import make_image_folder
from tests.faults.harness import Harness, Job, Result, is_loopback

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# A tiny 2-rank job: 640 samples / global batch 64 = 10 iterations per epoch, a check every iteration and a
# checkpoint every 2 iterations (two kept).
BASE = [
    "train",
    "--nproc",
    "2",
    "--backend",
    "gloo",
    "model.name=faultmod:make",
    "data.train_size=640",
    "data.val_size=100",
    "data.batch_size=64",
    "train.epochs=1",
    "train.check_every=1",
    "train.progress_bar=false",
    "checkpoint.every_iters=2",
    "checkpoint.n_saved=2",
]


def wait_until(cond: Callable[[], bool], job: Job, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if not job.running():
            job.wait(5)
            pytest.fail(f"the job exited ({job.proc.returncode}) before {what}\n{job.stderr[-6000:]}")
        time.sleep(0.1)
    job.kill_all()
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{job.stderr[-6000:]}")


# ----------------------------------------------------------------------------------------------- checkpoints


def checkpoints(out: Path) -> dict[int, Path]:
    from ignite_mgpu.checkpoint.files import list_checkpoints

    return {int(p.stem.split("_")[1]): p for p in list_checkpoints(out)}


def assert_loads(path: Path, iteration: int) -> None:
    from ignite_mgpu.checkpoint.files import is_complete, read_checkpoint

    assert is_complete(path), f"{path} is not a complete archive"
    ckpt = read_checkpoint(path)
    assert {"model", "optimizer", "trainer"} <= set(ckpt), sorted(ckpt)
    assert ckpt["trainer"]["iteration"] == iteration, (path, ckpt["trainer"])


def assert_last_good(out: Path, last: int) -> None:
    """The newest checkpoint is ``last``, it loads, nothing newer exists, and no temp file is left."""
    found = checkpoints(out)
    assert found, f"no checkpoint in {out}: {sorted(p.name for p in out.iterdir())}"
    assert max(found) == last, f"expected the newest checkpoint at iteration {last}, found {sorted(found)}"
    for it, path in found.items():
        assert_loads(path, it)
    assert not list(out.glob(".tmp-*")), "a temp file of an interrupted save was left behind"


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ----------------------------------------------------------------------------------------------- one clean run


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    """One successful 2-rank epoch; every_iters=3 so checkpoints 9 and 10 (epoch end) are kept."""
    root = tmp_path_factory.mktemp("clean")
    harness = Harness(root)
    out = root / "out"
    args = [*BASE, "checkpoint.every_iters=3", "--output-dir", str(out)]
    try:
        result = harness.run(args, timeout=120)
        assert result.rc == 0, result
        harness.assert_no_leftovers()
    finally:
        harness.cleanup()
    return out, result


@pytest.mark.timeout(180)
def test_s29_clean_run_checkpoints_are_private_and_complete(clean_run: tuple[Path, Result]) -> None:
    out, result = clean_run
    assert "finished" in result.stderr
    assert sorted(checkpoints(out)) == [9, 10]
    files = [*out.glob("checkpoint_*.pt"), *out.glob("best_model_*.pt")]
    assert len(files) == 3, sorted(p.name for p in out.iterdir())
    for path in files:
        mode = path.stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{path.name} has mode {oct(mode)}: group/other may read it"
    assert_last_good(out, 10)
    assert not (out / ".lock").exists(), "the output-dir lock outlived the job"


@pytest.mark.timeout(180)
def test_s25_output_dir_with_checkpoints_needs_resume(h: Harness, clean_run: tuple[Path, Result]) -> None:
    out = h.root / "out"
    shutil.copytree(clean_run[0], out)
    before = snapshot(out)
    r = h.run([*BASE, "--output-dir", str(out)], timeout=30)
    assert r.rc == 2, str(r)
    assert "already holds checkpoints" in r.stderr, str(r)
    assert "--resume" in r.stderr
    assert snapshot(out) == before, "files of the earlier run were changed or deleted"
    assert not h.jobs[0].recorded_pids(), "a rank was spawned"


@pytest.mark.timeout(180)
def test_s14_resume_auto_skips_a_truncated_newest_checkpoint(h: Harness, clean_run: tuple[Path, Result]) -> None:
    out = h.root / "out"
    shutil.copytree(clean_run[0], out)
    newest = out / "checkpoint_10.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    r = h.run([*BASE, "--output-dir", str(out), "--resume", "auto", "train.epochs=2"], timeout=90)
    assert r.rc == 0, str(r)
    assert re.search(r"checkpoint_10\.pt.*corrupt or truncated", r.stderr), str(r)
    assert re.search(r"resumed from \S*checkpoint_9\.pt at iteration 9", r.stderr), str(r)
    assert "finished" in r.stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["epoch"], last["iteration"]) == (2, 20), last
    h.assert_no_leftovers()


def _truncate_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip_tensor_bytes(data: bytes) -> bytes:
    # The middle of the file is tensor data (weights and momentum); the zip CRCs must notice.
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 64]) + data[mid + 64 :]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "damage", [_truncate_half, lambda d: b"", _flip_tensor_bytes], ids=["half", "empty", "bitflip"]
)
def test_s14_resume_from_a_corrupt_path_exits_1(h: Harness, clean_run: tuple[Path, Result], damage) -> None:
    out = h.root / "out"
    shutil.copytree(clean_run[0], out)
    bad = out / "checkpoint_10.pt"
    bad.write_bytes(damage(bad.read_bytes()))
    r = h.run([*BASE, "--output-dir", str(out), "--resume", str(bad), "train.epochs=2"], timeout=30)
    assert r.rc == 1, str(r)
    assert "corrupt or truncated" in r.stderr and "checkpoint_10.pt" in r.stderr, str(r)
    assert "Traceback" not in r.stderr, str(r)
    assert not h.jobs[0].recorded_pids(), "ranks were spawned for an unusable checkpoint"


@pytest.mark.timeout(120)
def test_final_checkpoint_survives_the_epoch_end_save(h: Harness) -> None:
    """checkpoint.every_iters divides the epoch: the epoch-end save of the same iteration must not delete it."""
    out = h.root / "out"
    args = [*BASE, "--nproc", "1", "data.train_size=256", "--output-dir", str(out)]  # 4 iterations
    r = h.run(args, timeout=60)
    assert r.rc == 0, str(r)
    assert sorted(checkpoints(out)) == [2, 4], sorted(p.name for p in out.iterdir())
    assert_last_good(out, 4)


# ----------------------------------------------------------------------------------------------- a rank fails


@pytest.mark.timeout(120)
def test_s1_rank_raises_reported_once_last_checkpoint_intact(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out)], fault="raise:1:5", timeout=45)
    assert r.rc == 1, str(r)
    assert "rank 1 failed with RuntimeError: boom" in r.stderr, str(r)
    assert r.stderr.count("Traceback (most recent call last)") == 1, str(r)
    assert r.stderr.count('raise RuntimeError("boom")') == 1, str(r)
    assert "rank 0 failed" not in r.stderr, str(r)
    h.assert_no_leftovers()
    assert_last_good(out, 4)


@pytest.mark.timeout(120)
def test_s1_checkpoint_in_progress_survives_another_ranks_failure(h: Harness) -> None:
    """Rank 0 takes 3 s to write checkpoint_4 (iteration 4 passed its check); rank 1 fails right after, in
    iteration 5. The checkpoint of a good iteration must still land: the launcher may not kill the writer
    mid-save (the survivors stop by themselves at their next collective, or after a grace)."""
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out)], fault="slowsave:0:4:3,raise:1:5", timeout=45)
    assert r.rc == 1, str(r)
    assert "rank 1 failed with RuntimeError: boom" in r.stderr, str(r)
    h.assert_no_leftovers()
    assert_last_good(out, 4)


@pytest.mark.timeout(180)
def test_s3_sigkilled_rank_then_resume_auto(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out)], fault="kill:1:5", timeout=45)
    assert r.rc == 1, str(r)
    assert "rank 1 terminated with signal SIGKILL" in r.stderr, str(r)
    h.assert_no_leftovers()
    assert_last_good(out, 4)

    r = h.run([*BASE, "--output-dir", str(out), "--resume", "auto", "train.epochs=2"], timeout=90, tag="b")
    assert r.rc == 0, str(r)
    assert re.search(r"resumed from \S*checkpoint_4\.pt at iteration 4", r.stderr), str(r)
    assert "finished" in r.stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["epoch"], last["iteration"]) == (2, 20), last
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_s4_rank0_sigkilled_job_ends_promptly(h: Harness) -> None:
    """Rank 0, the writer, is killed in iteration 5, right after it saved checkpoint_4. In the background (the
    default) that write may still be in flight, and a crash loses at most that one: then its temp file is there
    (the next start removes it) and checkpoint_2 is the newest; every checkpoint on disk is complete."""
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out)], fault="kill:0:5", timeout=45)
    assert r.rc == 1, str(r)
    assert "rank 0 terminated with signal SIGKILL" in r.stderr, str(r)
    h.assert_no_leftovers()
    found = checkpoints(out)
    for it, path in found.items():
        assert_loads(path, it)
    in_flight = list(out.glob(".tmp-*.pt"))
    assert (max(found), len(in_flight)) in ((4, 0), (2, 1)), (sorted(found), in_flight)


@pytest.mark.timeout(120)
def test_s20_nan_on_one_rank_stops_all_with_exit_3(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out)], fault="nan:1:7", timeout=30)
    assert r.rc == 3, str(r)
    assert re.search(r"non-finite loss.* at iteration 7 on rank 1", r.stderr), str(r)
    assert "Traceback" not in r.stderr, str(r)
    h.assert_no_leftovers()
    assert_last_good(out, 6)


@pytest.mark.timeout(120)
def test_s27_hung_rank_hits_the_collective_timeout(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out), "--timeout", "5"], fault="sleep:1:3", timeout=60)
    assert r.rc == 1, str(r)
    assert re.search(r"timed out after 5 s", r.stderr), str(r)
    assert "rank(s) 1 stopped answering" in r.stderr, str(r)
    h.assert_no_leftovers()
    assert_last_good(out, 2)


@pytest.mark.timeout(120)
def test_s28_model_constructor_raises_on_rank1(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out)], fault="init:1:0", timeout=30)
    assert r.rc == 1, str(r)
    assert "rank 1 failed with RuntimeError: init boom" in r.stderr, str(r)
    assert r.stderr.count("Traceback (most recent call last)") == 1, str(r)
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_dataloader_workers_do_not_outlive_a_failed_job(h: Harness) -> None:
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out), "data.num_workers=2"], fault="raise:1:5", timeout=60)
    assert r.rc == 1, str(r)
    assert "rank 1 failed with RuntimeError: boom" in r.stderr, str(r)
    pids_dir = h.jobs[0].pids_dir
    # idist.auto_dataloader splits num_workers over the ranks: one worker process per rank here.
    workers = {rank: (pids_dir / f"children{rank}").read_text().split() for rank in (0, 1)}
    assert all(workers.values()), f"expected a DataLoader worker in every rank: {workers}"
    # Gone when the launcher returns (2 s for the kernel): not 5 s later, when PyTorch's worker watchdog
    # would notice that its rank is dead.
    h.assert_no_leftovers(grace=2.0)


@pytest.mark.timeout(120)
def test_s2_data_loader_error_on_one_rank_unblocks_the_other(h: Harness) -> None:
    """One rank's DataLoader worker fails on an unreadable image while the other rank waits in its all-reduce:
    the job ends with that rank's error, reported once, well before any collective timeout."""
    root = make_image_folder(h.root / "images", {"train": 24, "val": 4}, 8, "train/dog/broken.png")
    data = ["data.name=imagefolder", f"data.root={root}", "data.image_size=8", "data.batch_size=8"]
    args = [*BASE, *data, "model.name=faultmod:make8", "model.num_classes=2", "data.num_workers=2"]
    r = h.run([*args, "--output-dir", str(h.root / "out")], timeout=45)  # fails the test beyond 45 s
    assert r.rc == 1, str(r)
    assert len(re.findall(r"rank \d failed with", r.stderr)) == 1, r  # the rank that read the file, not its peer
    assert "cannot read image" in r.stderr and "broken.png" in r.stderr, str(r)
    assert "timed out" not in r.stderr, r  # the waiting rank was released, not timed out
    h.assert_no_leftovers(grace=2.0)


ASYNC = ["checkpoint.async_save=true"]  # the default, named where a test is about it
SYNC = ["checkpoint.async_save=false"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("saving", [ASYNC, SYNC], ids=["async", "sync"])
def test_s19_writer_killed_mid_save_keeps_the_previous_checkpoint(h: Harness, saving: list[str]) -> None:
    """SIGKILL rank 0 while it is half-way through writing checkpoint_4 (async, the default: in the background
    thread, the training thread waiting at the next save; sync: in the step): checkpoint_2 stays the newest complete
    checkpoint, no partial file carries a checkpoint name, and the next start removes the temp file."""
    out = h.root / "out"
    job = h.start([*BASE, *saving, "--output-dir", str(out)], fault="slowwrite:0:4:60")
    marker = job.pids_dir / "halfwritten0"
    wait_until(marker.exists, job, 90, "a half-written checkpoint")
    assert list(out.glob(".tmp-*.pt")), sorted(p.name for p in out.iterdir())  # the writer's private temp file
    os.kill(int((job.pids_dir / "rank0").read_text()), signal.SIGKILL)
    r = job.wait(timeout=time.monotonic() - job.start + 45)  # 45 s after the kill
    assert r.rc == 1, str(r)
    assert "rank 0 terminated with signal SIGKILL" in r.stderr, str(r)
    h.assert_no_leftovers()
    assert sorted(checkpoints(out)) == [2], sorted(p.name for p in out.iterdir())
    assert_loads(out / "checkpoint_2.pt", 2)
    assert list(out.glob(".tmp-*.pt")), "the killed writer's temp file should still be there"

    r = h.run([*BASE, *saving, "--output-dir", str(out), "--resume", "auto"], timeout=90, tag="b")
    assert r.rc == 0, str(r)
    assert re.search(r"resumed from \S*checkpoint_2\.pt at iteration 2", r.stderr), str(r)
    assert_last_good(out, 10)  # also: the stale temp file is gone
    h.assert_no_leftovers()


@pytest.mark.timeout(180)
def test_sigterm_during_a_background_write_finishes_it_then_saves_the_stop(h: Harness) -> None:
    """checkpoint.async_save: SIGTERM while checkpoint_4 is half-written in the background (3 s): the job stops
    at a common iteration, the stop's save waits for checkpoint_4, writes its own, and the worker exits only
    once both are complete."""
    out = h.root / "out"
    args = [*BASE, *ASYNC, "--output-dir", str(out), "dist.stop_grace=30", "checkpoint.n_saved=3"]
    job = h.start(args, fault="slowwrite:0:4:3,slow:*:1:0.1")
    wait_until((job.pids_dir / "halfwritten0").exists, job, 90, "a half-written background checkpoint")
    os.kill(job.pid, signal.SIGTERM)
    r = job.wait(timeout=60)
    assert r.rc == 143, str(r)
    m = re.search(r"stopped by SIGTERM at iteration (\d+)", r.stderr)
    assert m and int(m.group(1)) > 4, str(r)
    h.assert_no_leftovers()
    assert_last_good(out, int(m.group(1)))  # every file complete, no temp file
    assert 4 in checkpoints(out), sorted(p.name for p in out.iterdir())


# ----------------------------------------------------------------------------------------------- signals


SLOW = "slow:*:1:0.25"  # every rank sleeps 0.25 s per iteration: 20 iterations take >= 5 s


@pytest.mark.timeout(180)
def test_s5_sigterm_checkpoints_at_a_common_iteration_then_resume(h: Harness) -> None:
    """SIGTERM as `timeout 1h ignite-mgpu train ...` sends it: to the launcher, then to its process group, so the
    launcher gets it twice (here 50 ms apart, as on a loaded machine: the first handler has run when the second
    comes). That is one request: the stop's checkpoint is written."""
    out = h.root / "out"
    args = [*BASE, "--output-dir", str(out), "train.epochs=2", "dist.stop_grace=15"]
    job = h.start(args, fault=SLOW)
    wait_until(lambda: (out / "checkpoint_2.pt").exists(), job, 90, "the first checkpoint")
    signalled = time.monotonic()
    os.kill(job.pid, signal.SIGTERM)
    time.sleep(0.05)
    os.killpg(job.pid, signal.SIGTERM)  # the launcher leads its session: its group
    r = job.wait(timeout=signalled - job.start + 15 + 30)
    assert r.rc == 143, str(r)
    m = re.search(r"stopped by SIGTERM at iteration (\d+)", r.stderr)
    assert m, str(r)
    stopped_at = int(m.group(1))
    assert 2 <= stopped_at < 20, str(r)
    # The stop line names the checkpoint it wrote and the command that goes on from it.
    said = f"last checkpoint {out / f'checkpoint_{stopped_at}.pt'}; go on from it with `ignite-mgpu train "
    assert said in r.stderr and f"{out / 'config.yaml'} --resume auto`" in r.stderr, str(r)
    h.assert_no_leftovers()
    assert_last_good(out, stopped_at)  # one checkpoint written at the stop, complete

    r = h.run([*BASE, "--output-dir", str(out), "--resume", "auto", "train.epochs=2"], timeout=90, tag="b")
    assert r.rc == 0, str(r)
    assert re.search(rf"resumed from \S*checkpoint_{stopped_at}\.pt at iteration {stopped_at}", r.stderr), str(r)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["epoch"], last["iteration"]) == (2, 20), last
    h.assert_no_leftovers()


@pytest.mark.timeout(120)
def test_s5_sigterm_escalates_to_sigkill_when_a_rank_is_stuck(h: Harness) -> None:
    out = h.root / "out"
    args = [*BASE, "--output-dir", str(out), "dist.stop_grace=2"]  # nothing can stop in it: no need to wait long
    job = h.start(args, fault="sleep:1:3")  # rank 1 hangs in iteration 3; rank 0 waits in its all-reduce
    wait_until(lambda: (out / "checkpoint_2.pt").exists(), job, 90, "the first checkpoint")
    time.sleep(1)
    signalled = time.monotonic()
    os.kill(job.pid, signal.SIGTERM)
    r = job.wait(timeout=signalled - job.start + 2 + 30)
    assert r.rc == 143, str(r)
    assert "did not stop within 2 s" in r.stderr, str(r)
    h.assert_no_leftovers()
    assert_last_good(out, 2)


@pytest.mark.timeout(120)
def test_a_second_signal_while_a_checkpoint_is_written_names_no_iteration(h: Harness) -> None:
    """SIGTERM, then Ctrl-C while checkpoint_4 is being written (its state_dict takes 60 s): the job stops at once
    and says that checkpoint was not written, never "stopped ... at iteration N" as if it had been."""
    out = h.root / "out"
    job = h.start([*BASE, *SYNC, "--output-dir", str(out), "dist.stop_grace=60"], fault="slowsave:*:4:60")
    wait_until((job.pids_dir / "saving0").exists, job, 90, "iteration 4's checkpoint being written")
    os.kill(job.pid, signal.SIGTERM)
    time.sleep(1)
    os.kill(job.pid, signal.SIGINT)  # the second signal: stop at once
    r = job.wait(timeout=time.monotonic() - job.start + 30)
    assert r.rc == 143, str(r)
    last = r.stderr.strip().splitlines()[-2:]
    assert any("at once, while a checkpoint was being written: it was not written." in ln for ln in last), str(r)
    assert "at iteration" not in " ".join(last), str(r)
    h.assert_no_leftovers()
    assert sorted(checkpoints(out)) == [2], sorted(p.name for p in out.iterdir())
    assert_loads(out / "checkpoint_2.pt", 2)


@pytest.mark.timeout(120)
def test_s6_ctrl_c_to_the_process_group_exits_130(h: Harness) -> None:
    out = h.root / "out"
    job = h.start([*BASE, "--output-dir", str(out), "train.epochs=2", "dist.stop_grace=15"], fault=SLOW)
    wait_until(lambda: (out / "checkpoint_2.pt").exists(), job, 90, "the first checkpoint")
    signalled = time.monotonic()
    os.killpg(job.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    r = job.wait(timeout=signalled - job.start + 15 + 30)
    assert r.rc == 130, str(r)
    assert "SIGINT" in r.stderr, str(r)
    assert "finished" not in r.stderr, str(r)
    h.assert_no_leftovers()
    found = checkpoints(out)
    assert found and max(found) < 20, sorted(found)
    assert_last_good(out, max(found))  # complete archives only, no temp file


@pytest.mark.timeout(180)
def test_s7_sigkilled_launcher_takes_its_workers_along(h: Harness) -> None:
    out = h.root / "out"
    job = h.start([*BASE, "--output-dir", str(out), "train.epochs=2"], fault=SLOW)
    wait_until(lambda: (out / "checkpoint_2.pt").exists() and len(job.recorded_pids()) == 2, job, 90, "the checkpoint")
    time.sleep(0.3)  # let the sampler see the whole tree
    job.proc.kill()
    job.wait(timeout=120)
    h.assert_no_leftovers(grace=30)
    # Nothing holds the output dir: the stale lock of the dead launcher does not block the resume.
    r = h.run([*BASE, "--output-dir", str(out), "--resume", "auto", "train.epochs=2"], timeout=90, tag="b")
    assert r.rc == 0, str(r)
    assert "finished" in r.stderr
    h.assert_no_leftovers()


# ----------------------------------------------------------------------------------------------- ports, locks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("holder", ["socket", "tcpstore"])
def test_s8_busy_master_port_exits_2_before_spawning(h: Harness, holder: str) -> None:
    out = h.root / "out"
    with contextlib.ExitStack() as stack:
        if holder == "socket":
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            port = sock.getsockname()[1]
        else:  # a foreign job's TCPStore: must be refused, never joined
            from torch.distributed import TCPStore

            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # alive until the end
            port = store.port
        r = h.run([*BASE, "--output-dir", str(out), "--master-port", str(port)], timeout=15)
    assert r.rc == 2, str(r)
    assert f"{port}" in r.stderr and "already in use" in r.stderr, str(r)
    assert not h.jobs[0].recorded_pids(), "a rank was spawned"
    assert not out.exists()


@pytest.mark.timeout(180)
def test_s8_s9_two_jobs_without_port_share_the_host_on_loopback_only(h: Harness) -> None:
    jobs = [
        h.start([*BASE, "--output-dir", str(h.root / f"out-{tag}")], fault="slow:*:1:0.2", tag=tag, watch_sockets=True)
        for tag in ("a", "b")
    ]
    rendezvous: dict[str, bool] = {"a": False, "b": False}
    while any(j.running() for j in jobs):
        for tag in rendezvous:  # a single-node job without --master-port rendezvous through a private file
            rendezvous[tag] |= bool(list((h.root / f"tmp-{tag}").glob("ignite-mgpu-*/rendezvous")))
        if time.monotonic() - jobs[0].start > 150:
            break
        time.sleep(0.1)
    results = [j.wait(timeout=160) for j in jobs]
    for r in results:
        assert r.rc == 0, str(r)
        assert "finished" in r.stderr
    assert rendezvous == {"a": True, "b": True}, "no file rendezvous was seen"
    for tag in rendezvous:
        left = list((h.root / f"tmp-{tag}").glob("ignite-mgpu-*"))
        assert not left, f"the launcher left its private temp folder behind: {left}"
    for job in jobs:
        assert job.socket_samples > 0, "the sampler never saw both ranks' sockets"
        exposed = [(pid, ip, port) for pid, ip, port in job.listeners if not is_loopback(ip)]
        assert not exposed, f"sockets listening beyond loopback: {exposed} (all: {sorted(job.listeners)})"
        assert not [x for x in job.listeners if x[2] == 29500], "something listens on the default master port"
    h.assert_no_leftovers()


@pytest.mark.timeout(180)
def test_s30_second_launch_on_a_locked_output_dir_fails_fast(h: Harness) -> None:
    out = h.root / "out"
    args = [*BASE, "--output-dir", str(out), "train.epochs=2"]
    first = h.start(args, fault="hold:*:3", tag="a")  # its ranks wait in iteration 3 until released below
    wait_until(lambda: (out / "checkpoint_2.pt").exists(), first, 90, "the first job's checkpoint")
    seconds = [h.start(args, tag="b"), h.start([*args, "--resume", "auto"], tag="c")]
    results = [j.wait(timeout=15, what="the second launch") for j in seconds]
    assert first.running(), "test precondition: the first job finished before the second launches were refused"
    for r in results:
        assert r.rc == 2, str(r)
        assert f"locked by pid {first.pid}" in r.stderr, str(r)
    assert not any(j.recorded_pids() for j in seconds), "the second launch spawned ranks"
    (first.pids_dir / "release").write_text("")
    r = first.wait(timeout=120)
    assert r.rc == 0, r  # the first job is unharmed
    assert "finished" in r.stderr
    h.assert_no_leftovers()


# ----------------------------------------------------------------------------------------------- bad input


_BAD_YAML = "data:\n  batch_size: [64\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--nproc", "0"], ["dist.nproc", "0"]),
        (["--nproc", "-1"], ["dist.nproc", "-1"]),
        (["--nproc", "abc"], ["--nproc", "abc"]),
        (["train.epochs=-1"], ["train.epochs", "-1"]),
        (["data.batch_size=0"], ["data.batch_size", "0"]),
        (["optim.lr=nan"], ["optim.lr", "nan"]),
        (["--backend", "abc"], ["--backend", "abc"]),
        (["optim.lrr=0.1"], ["optim.lrr", "did you mean optim.lr=0.1?"]),
        (["--config", "BAD_YAML"], ["bad.yaml", "not valid YAML"]),
        (["--backend", "nccl"], ["nccl needs CUDA"]),
    ],
    ids=["nproc0", "nproc-1", "nproc-abc", "epochs-1", "batch0", "lr-nan", "backend-abc", "typo", "yaml", "nccl"],
)
def test_s10_s11_bad_input_exits_2_before_spawning(h: Harness, extra: list[str], expected: list[str]) -> None:
    bad_yaml = h.root / "bad.yaml"
    bad_yaml.write_text(_BAD_YAML)
    extra = [str(bad_yaml) if x == "BAD_YAML" else x for x in extra]
    out = h.root / "out"
    r = h.run([*BASE, "--output-dir", str(out), *extra], timeout=30)
    assert r.rc == 2, str(r)
    for text in expected:
        assert text in r.stderr, f"{text!r} not in the message\n{r}"
    assert "Traceback" not in r.stderr, str(r)
    assert not out.exists(), "the output dir was created for a rejected job"
    assert not h.jobs[0].recorded_pids(), "a rank was spawned"
    spawned = [c for c in h.jobs[0].cmdlines.values() if "multiprocessing" in c]
    assert not spawned, f"worker processes were started: {spawned}"


# ----------------------------------------------------------------------------------------------- soak


@pytest.mark.timeout(120)
def test_soak_memory_stays_flat_over_20k_iterations(h: Harness) -> None:
    """One process, 20 epochs x 1000 tiny iterations (batch 8, 8x8 images), a checkpoint every epoch: the peak
    RSS (metrics.jsonl peak_memory_mb) may grow by at most 20 MB between epoch 2 and the last epoch."""
    out = h.root / "out"
    args = [
        "train",
        "--nproc",
        "1",
        "--output-dir",
        str(out),
        "model.name=faultmod:make8",
        "data.image_size=8",
        "data.batch_size=8",
        "data.train_size=800",
        "data.val_size=16",
        "train.epoch_length=1000",
        "train.epochs=20",
        "train.check_every=20",
        "train.progress_bar=false",
    ]
    r = h.run(args, timeout=100)
    assert r.rc == 0, str(r)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == list(range(1, 21))
    assert rows[-1]["iteration"] == 20_000
    growth = rows[-1]["peak_memory_mb"][0] - rows[1]["peak_memory_mb"][0]
    assert growth < 20, f"peak RSS grew by {growth:.1f} MB from epoch 2 to 20: {[x['peak_memory_mb'] for x in rows]}"
    h.assert_no_leftovers()
