"""GPU claims on a shared machine (gpus/claims.py, gpus/acquire.py) with the 4-GPU stand-in nvidia-smi
(tests/fake_gpus): jobs started together never share a GPU, a waiting job starts when its GPUs are free and in the
order jobs began waiting, a killed holder frees its GPUs at once, a hostile claims folder fools nobody, and
`ignite-mgpu devices` shows who holds what. Real processes where it matters (tests/gpus/claimer.py).

Run: python -m pytest tests/gpus/test_claims.py -q
"""

import json
import math
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.schema import Config, DistConfig
from ignite_mgpu.errors import WAIT_TIMEOUT, ConfigError, WaitInterrupted, WaitTimedOut
from ignite_mgpu.gpus import acquire, claims, holders, inventory
from ignite_mgpu.gpus.selection import GpusTaken
from ignite_mgpu.processes import launcher
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.outcome import Outcome
from ignite_mgpu.processes.plan import make_plan
from tests.conftest import REPO, run_cli

FAKE = REPO / "tests" / "fake_gpus"
CLAIMER = Path(__file__).with_name("claimer.py")
UUID = "GPU-a1000000-0000-4000-8000-00000000000{}".format  # the stand-in's GPU i
TABLE = "".join(
    f"{i}, 00000000:{bus}:00.0, NVIDIA A100-SXM4-80GB, {used}, 81920, 0, Disabled, {UUID(i)}\n"
    for i, (bus, used) in enumerate([("07", 71680), ("0F", 40960), ("47", 1), ("4E", 1)])
)


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """The stand-in nvidia-smi for this process (the suite hides the real one) and its children; returns the folder
    whose gpus.csv / apps.csv change its answers."""
    answers = tmp_path / "answers"
    answers.mkdir()
    monkeypatch.setenv("FAKE_NVIDIA_SMI_DIR", str(answers))
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # what a plan on GPUs exports

    def run(argv):
        return subprocess.run([str(FAKE / "nvidia-smi"), *argv[1:]], capture_output=True, text=True, check=True).stdout

    monkeypatch.setattr(inventory, "_run_nvidia_smi", run)
    return answers


def claims_dir() -> Path:
    return Path(os.environ[claims.CLAIMS_DIR_ENV])


class Job:
    """tests/gpus/claimer.py in its own session: its JSON lines and its stderr, read as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CLAIMER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _read(stream, put):
        for line in stream:
            put(line)

    def line(self, timeout: float = 30) -> dict:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            pytest.fail(f"no answer within {timeout} s; stderr: {''.join(self.stderr)[-2000:]}")

    def waiting(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while not any("waiting for" in line for line in self.stderr):
            assert time.monotonic() < end and self.proc.poll() is None, "".join(self.stderr)[-2000:]
            time.sleep(0.01)

    def release(self) -> float:
        """Close stdin (the job lets its claims go and exits); returns when that happened."""
        at = time.time()
        self.proc.stdin.close()
        assert self.proc.wait(20) == 0, "".join(self.stderr)[-2000:]
        return at

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(20)


@pytest.fixture
def jobs():
    started: list[Job] = []

    def start(*args: str) -> Job:
        started.append(Job(*args))
        return started[-1]

    yield start
    for job in started:
        job.kill()


def hold_here(*ids: int) -> claims.GpuClaims:
    """A claim held by this process (another open file than a job's, so it conflicts like another job's)."""
    fd = claims.open_dir(str(claims_dir()), create=True)
    try:
        held = claims.claim(fd, [UUID(i) for i in ids])
    finally:
        os.close(fd)
    assert held is not None
    return held


def claimed() -> dict[str, holders.Holder]:
    fd = claims.open_dir(str(claims_dir()), create=False)
    try:
        return holders.holders(fd, [UUID(i) for i in range(4)])
    finally:
        if fd is not None:
            os.close(fd)


# --- jobs started together, waiting, killed holders -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_auto_jobs_started_together_never_share_a_gpu(fake_gpus, jobs, tmp_path):
    for repetition in range(20):
        go = tmp_path / f"go{repetition}"
        pair = [jobs("--gpus", "auto:2", "--hold", "--go", str(go)) for _ in range(2)]
        assert [job.line() for job in pair] == [{"ready": True}] * 2
        go.touch()  # both start at the same instant
        got = [job.line() for job in pair]
        assert all(len(g["gpus"]) == 2 for g in got), got
        assert not set(got[0]["gpus"]) & set(got[1]["gpus"]), f"repetition {repetition}: {got}"
        assert sorted(got[0]["gpus"] + got[1]["gpus"]) == [0, 1, 2, 3]
        for job in pair:
            job.release()
    assert claimed() == {}


@pytest.mark.timeout(120)
def test_waiting_jobs_start_when_the_gpus_are_free_in_the_order_they_began_waiting(fake_gpus, jobs):
    holder = jobs("--gpus", "auto:2", "--hold")
    assert holder.line()["gpus"] == [2, 3]
    # GPUs 0 and 1 run other processes and have too little free memory: not free for a waiting job.
    first = jobs("--gpus", "auto:2", "--wait", "60", "--hold", "--poll", "0.2")
    first.waiting()
    assert re.search(
        r"waiting for 2 free GPUs \(--gpus auto:2; (1 min|59 s) left\): GPU 0 runs 1 process \(pid 23817 of .*\) "
        r"and has 10\.0 of 80\.0 GiB free, 72\.0 needed; GPU 1 .*; GPU 2 is claimed by \S+ \(pid \d+, "
        r"`claimer\.py --gpus auto:2 --hold`, since .*\); GPU 3 is claimed by",
        "".join(first.stderr),
    ), first.stderr
    # The later job looks ten times as often: only the queue makes it let the earlier one go first.
    second = jobs("--gpus", "auto:2", "--wait", "60", "--hold", "--poll", "0.02")
    second.waiting()
    assert re.search(r"; in line before it: \S+ \(pid \d+, `claimer.py --gpus auto:2 --wait 60 --hold --poll 0.2`, "
                     r"since [-0-9: ]+\)\.", "".join(second.stderr)), second.stderr  # fmt: skip
    freed = holder.release()
    got = first.line()
    assert got["gpus"] == [2, 3]
    print(f"the first waiting job claimed its GPUs {got['at'] - freed:.2f} s after they were free (poll 0.2 s)")
    assert got["at"] - freed < 5  # within a few polls, not at the next once-a-minute line
    assert second.lines.empty()  # still waiting: the GPUs are the first job's now
    freed = first.release()
    assert second.line()["gpus"] == [2, 3] and second.release() > freed
    assert any(re.fullmatch(r"ignite-mgpu: waited [\d.]+ s; claimed GPU 2,3\.\n", line) for line in first.stderr)


@pytest.mark.timeout(60)
def test_a_killed_holders_gpus_are_free_at_once(fake_gpus, jobs):
    holder = jobs("--gpus", "2,3", "--hold")
    assert holder.line()["claimed"] == [UUID(2), UUID(3)]
    assert set(claimed()) == {UUID(2), UUID(3)}
    holder.kill()  # SIGKILL: no cleanup ran, the kernel dropped the flocks
    plan, held = acquire.acquire(DistConfig(gpus="2,3"), os.environ)
    with held:
        assert plan.physical_ids == [2, 3] and held.names == [UUID(2), UUID(3)]


def test_the_wait_times_out_with_its_own_exit_code_and_one_paragraph(fake_gpus, tmp_path, monkeypatch):
    monkeypatch.setattr(acquire, "POLL", 0.05)
    with hold_here(2):
        result = CliRunner().invoke(
            main, ["train", "--gpus", "2", "--output-dir", str(tmp_path / "run"), "--wait", "0.3"]
        )
    assert result.exit_code == WAIT_TIMEOUT == 4
    assert re.search(
        r"ignite-mgpu: waiting for 1 free GPU \(--gpus 2; 0.3 s left\): GPU 2 is claimed by", result.output
    )
    assert re.search(
        rf"ignite-mgpu: error: --wait 0\.3: --gpus 2 did not find 1 free GPU within 0\.3 s: GPU 2 is claimed by \S+ "
        rf"\(pid {os.getpid()}, `[^`]+`, since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\)\. Nothing was started\. Wait longer "
        r"\(--wait alone waits without a limit\), ask for other GPUs, or run beside the other jobs on purpose with "
        r"--share\.\n$",
        result.output,
    ), result.output


@pytest.mark.timeout(120)
def test_the_real_command_waits_then_ends_with_exit_code_4(fake_gpus, jobs, tmp_path):
    holder = jobs("--gpus", "2", "--hold")
    assert holder.line()["gpus"] == [2]
    result = run_cli(["train", "--gpus", "2", "--output-dir", str(tmp_path / "run"), "--wait", "0.5"], tmp_path)
    assert result.returncode == 4, result.stderr[-3000:]
    waiting = (
        r"^ignite-mgpu: waiting for 1 free GPU \(--gpus 2; 0.5 s left\): GPU 2 is claimed by \S+ \(pid "
        rf"{holder.proc.pid}, `claimer.py --gpus 2 --hold`, since "
    )
    assert re.search(waiting, result.stderr, re.M), result.stderr
    assert (
        "ignite-mgpu: error: --wait 0.5: --gpus 2 did not find 1 free GPU within 0.5 s: GPU 2 is claimed"
        in result.stderr
    )


@pytest.mark.timeout(120)
def test_run_waits_in_line_as_train_does_and_shares_on_purpose(fake_gpus, jobs, tmp_path):
    """`ignite-mgpu run` takes the GPUs the way train does: in line with --wait (exit code 4 when it runs out,
    the script never started), beside the other jobs' claims with --share."""
    holder = jobs("--gpus", "2", "--hold")
    assert holder.line()["gpus"] == [2]
    (tmp_path / "train.py").write_text("open('started', 'w').close()\n")
    result = run_cli(["run", "--gpus", "2", "--wait", "0.5", "train.py"], tmp_path)
    assert result.returncode == 4, result.stderr[-3000:]
    waiting = (
        r"^ignite-mgpu: waiting for 1 free GPU \(--gpus 2; 0.5 s left\): GPU 2 is claimed by \S+ \(pid "
        rf"{holder.proc.pid}, `claimer.py --gpus 2 --hold`, since "
    )
    assert re.search(waiting, result.stderr, re.M), result.stderr
    assert "ignite-mgpu: error: --wait 0.5: --gpus 2 did not find 1 free GPU within 0.5 s" in result.stderr
    refused = run_cli(["run", "--gpus", "2", "train.py"], tmp_path)
    assert refused.returncode == 2 and "GPU 2 is claimed by" in refused.stderr, refused.stderr[-3000:]
    # Past the claims: PyTorch here sees none of the stand-in's GPUs.
    shared = run_cli(["run", "--gpus", "2", "--share", "train.py"], tmp_path)
    assert shared.returncode == 2 and "PyTorch sees no CUDA device" in shared.stderr, shared.stderr[-3000:]
    assert not (tmp_path / "started").exists()


def _group_ends(pgid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)
    return False


class _CtrlCWhileWaiting:
    """acquire's ``time`` with a Ctrl-C in the first sleep between two looks."""

    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def sleep(seconds: float) -> None:
        raise KeyboardInterrupt


def test_ctrl_c_while_waiting_ends_with_130_and_one_paragraph_and_gives_up_the_place_in_line(
    fake_gpus, tmp_path, monkeypatch
):
    monkeypatch.setattr(acquire, "time", _CtrlCWhileWaiting)
    with hold_here(2):
        result = CliRunner().invoke(main, ["train", "--gpus", "2", "--output-dir", str(tmp_path / "run"), "--wait"])
        with pytest.raises(WaitInterrupted, match=r"^Ctrl-C after 0 s of waiting for 2 free GPUs \(--gpus auto:2\)"):
            acquire.acquire(DistConfig(gpus="auto:2", wait=60.0), os.environ)
    assert result.exit_code == WaitInterrupted.exit_code == 130, result.output
    assert result.output.endswith(
        "ignite-mgpu: error: Ctrl-C after 0 s of waiting for 1 free GPU (--gpus 2): nothing was started, no GPU is "
        "claimed, and this job's place in line is given up.\n"
    ), result.output
    assert "Aborted!" not in result.output
    assert not list(claims_dir().glob("wait-*")), "the ticket in line is removed"
    assert claimed() == {}


@pytest.mark.timeout(120)
def test_the_real_command_interrupted_while_waiting_exits_130_without_a_traceback(fake_gpus, jobs, tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole foreground group (the command and its fork server), at once and
    after the fork server's imports; SIGTERM (`kill`, a scheduler), which ended the command without a word."""
    holder = jobs("--gpus", "2", "--hold")
    assert holder.line()["gpus"] == [2]
    for sent, settle in ((signal.SIGINT, 0.0), (signal.SIGINT, 8.0), (signal.SIGTERM, 0.0)):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ignite_mgpu",
                "train",
                "--gpus",
                "2",
                "--output-dir",
                str(tmp_path / "run"),
                "--wait",
            ],
            cwd=tmp_path,
            env=os.environ | {"PYTHONPATH": str(REPO)},
            text=True,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        stderr: list[str] = []
        reader = threading.Thread(target=stderr.extend, args=(proc.stderr,), daemon=True)
        reader.start()
        end = time.monotonic() + 60
        while not any("waiting for" in line for line in stderr):
            assert time.monotonic() < end and proc.poll() is None, "".join(stderr)[-3000:]
            time.sleep(0.02)
        time.sleep(settle)
        os.killpg(proc.pid, sent)
        code = proc.wait(30)
        reader.join(10)
        text = "".join(stderr)
        assert code == 128 + sent, text[-3000:]
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        name = "Ctrl-C" if sent == signal.SIGINT else "SIGTERM"
        assert re.search(
            rf"^ignite-mgpu: error: {name} after [\d.]+ s of waiting for 1 free GPU \(--gpus 2\): "
            r"nothing was started, no GPU is claimed, and this job's place in line is given up\.$",
            text,
            re.M,
        ), text[-3000:]
        assert _group_ends(proc.pid, 10), "a process of the command (its fork server?) outlived it"


def test_a_gpu_claimed_by_another_job_is_refused_naming_the_holder_and_the_fixes(fake_gpus, tmp_path):
    out = str(tmp_path / "run")
    with hold_here(2):
        result = CliRunner().invoke(main, ["train", "--gpus", "1,2", "--output-dir", out])
        assert result.exit_code == 2
        assert re.fullmatch(
            rf"ignite-mgpu: error: --gpus 1,2: GPU 2 is claimed by \S+ \(pid {os.getpid()}, `[^`]+`, since "
            r"[-0-9: ]+\)\. Choose other GPUs with --gpus \(GPU 0,3 are not taken\), wait for it with --wait "
            r"\[SECONDS\], or run beside the other job on purpose with --share\.\n",
            result.output,
        ), result.output
        with pytest.raises(GpusTaken, match=r"^--gpus auto:4 needs 4 GPUs that no other job has, but 3 of the 4 are "):
            acquire.acquire(DistConfig(gpus="auto:4"), os.environ)
        with pytest.raises(ConfigError, match=r"Choose other GPUs with --gpus \(GPU 0,1,3 are not taken\)"):
            launcher.launch(print, gpus="2")
        # --share runs beside the claim: it gets as far as the CPU-only torch of this machine.
        shared = CliRunner().invoke(main, ["train", "--gpus", "2", "--share", "--output-dir", out])
        assert shared.exit_code == 2 and "PyTorch sees no CUDA device" in shared.output, shared.output


def test_a_job_that_keeps_losing_the_race_and_a_file_system_without_flock_say_so(fake_gpus, monkeypatch):
    import fcntl

    with monkeypatch.context() as patched:
        patched.setattr(claims, "claim", lambda dir_fd, names, gpu_range="": None)  # another job wins every time
        with pytest.raises(ConfigError, match=r"^--gpus auto:2: other jobs kept claiming the GPUs this job chose, 20 "):
            acquire.acquire(DistConfig(gpus="auto:2"), os.environ)

    def no_flock(fd, operation):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(ConfigError, match=r"^cannot lock GPU claims in .* \(No locks available\): its file system has"):
        acquire.acquire(DistConfig(gpus="2"), os.environ)


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs of its own, mounted with the options given: a read-only or a full file system as the kernel makes
    them (root, and a kernel that lets it mount; skipped elsewhere)."""
    mounted = []

    def mount(options: str) -> Path:
        where = tmp_path / f"mount{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here (root only): {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.parametrize(
    "options, folder, why",
    [
        ("ro,mode=1777", "", r"it is on a read-only file system \(Read-only file system, EROFS\)"),
        ("ro,mode=1777", "claims", r"it does not exist and cannot be made: it is on a read-only file system \(Read"),
        ("nr_inodes=1,mode=1777", "", r"its disk is full \(No space left on device, ENOSPC\)"),
    ],
)  # fmt: skip
def test_a_read_only_or_full_claims_folder_is_said_so_with_its_errno_never_a_lost_race(
    fake_gpus, tmpfs, monkeypatch, tmp_path, options, folder, why
):
    """It said "other jobs kept claiming the GPUs this job chose, 20 times in a row"; with --wait 12 "the GPUs are
    free, another job just took them", exit 4; with --wait alone it waited forever. Now: exit 2 at once, the folder,
    what is wrong and its errno, waiting or not."""
    path = tmpfs(options) / folder
    monkeypatch.setenv(claims.CLAIMS_DIR_ENV, str(path))
    said = rf"^the GPU claims folder {re.escape(str(path).rstrip('/'))}/? cannot be used: {why}.*?\. Every job on GPUs"
    for wait in (None, 12.0, math.inf):
        started = time.monotonic()
        with pytest.raises(ConfigError, match=said) as refused:
            acquire.acquire(DistConfig(gpus="2", wait=wait), os.environ)
        assert type(refused.value) is ConfigError and time.monotonic() - started < 5, wait
    result = CliRunner().invoke(main, ["train", "--gpus", "2", "--wait", "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and re.search(why, result.output), result.output


def test_auto_skips_gpus_that_other_jobs_claim(fake_gpus):
    with hold_here(2):
        plan, held = acquire.acquire(DistConfig(gpus="auto:2"), os.environ)
        with held:
            assert plan.physical_ids == [1, 3]  # GPU 2 is claimed; GPU 1 is the idlest of the rest
            assert "Not enough idle GPUs: GPU 1 already runs other work." in plan.messages


def test_the_plan_holds_the_claims_until_the_job_ends_and_lets_them_go_on_a_failed_check(fake_gpus, monkeypatch):
    import torch

    # This machine's torch has no CUDA: the plan's device check fails after the claim, which must not stay.
    with pytest.raises(ConfigError, match="PyTorch sees no CUDA device"):
        make_plan(DistConfig(gpus="2"))[0]
    assert claimed() == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    plan, held = make_plan(DistConfig(gpus="2"))
    assert held.names == [UUID(2)] and set(claimed()) == {UUID(2)}
    assert pickle.loads(pickle.dumps(held)).names == []  # a spawned worker holds nothing
    assert not hasattr(pickle.loads(pickle.dumps(plan)), "claims")  # and its plan names none
    assert all(not os.get_inheritable(fd) for fd in held._fds)  # nor does any process started by exec
    held.close()
    during = []
    monkeypatch.setattr(launcher, "run_job", lambda *args, **kwargs: during.append(claimed()) or Ended(Outcome(0)))
    assert launcher.launch(print, gpus="2") is None
    assert list(during[0]) == [UUID(2)] and claimed() == {}  # held while the job ran, let go when it ended


def test_jobs_on_the_cpu_claim_nothing():
    for dist in (DistConfig(), DistConfig(gpus="none"), DistConfig(nproc=2, wait=10.0)):
        plan, held = make_plan(dist)
        assert plan.device == "cpu" and held.names == []
    assert list(claims_dir().iterdir()) == []


@pytest.mark.parametrize(
    "exported, ids", [(None, [0, 1, 2, 3]), ("1,3", [1, 3]), ("GPU-a1000000-0000-4000-8000-000000000002", [2])]
)
def test_without_gpus_a_job_claims_what_cuda_visible_devices_shows(fake_gpus, monkeypatch, exported, ids):
    if exported is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", exported)
    with acquire.acquire(DistConfig(), os.environ)[1] as held:
        assert held.names == [UUID(i) for i in ids]
        with pytest.raises(
            GpusTaken, match=rf"^--gpus not given: the GPUs this job would use: GPU {ids[0]} is claimed"
        ):
            acquire.acquire(DistConfig(), os.environ)


def test_gpus_none_claims_nothing_even_when_asked_through_acquire(fake_gpus):
    plan, held = acquire.acquire(DistConfig(gpus="none", wait=5.0), os.environ)
    assert plan.physical_ids is None and held.names == [] and list(claims_dir().iterdir()) == []


# --- a hostile claims folder ------------------------------------------------------------------------------------


def live_claim(name: str, content: bytes) -> list[int]:
    """A claim by "another job" whose holder file says ``content``: both files flocked through fds of their own."""
    import fcntl

    folder = claims_dir()
    lock = os.open(folder / f"{name}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    holder = os.open(folder / f"{name}.{os.geteuid()}.holder", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(holder, content)
    for fd in (lock, holder):
        fcntl.flock(fd, fcntl.LOCK_EX)
    return [lock, holder]


@pytest.mark.parametrize(
    "content, shown",
    [
        (b"\x00\xff garbage {{{", "an unknown job (its holder file is unreadable)"),
        (b"[" * 5000, "an unknown job (its holder file is unreadable)"),  # nested past json's recursion limit
        (b'{"pid": "1; rm -rf /", "command": 7, "since": "yesterday"}', "(no pid)"),
        (b'{"pid": 42, "command": "\\u001b[2J\\u001b]0;owned\\u0007train", "since": 1e300}', "`?[2J?]0;owned?train`"),
    ],
)
def test_a_garbage_holder_file_is_an_unknown_job_never_a_crash(fake_gpus, content, shown):
    fds = live_claim(UUID(2), content)
    try:
        who = claimed()[UUID(2)]
        text = who.describe()
        assert shown in text if shown != "(no pid)" else text == who.user
        assert "\x1b" not in text and who.since is None
        plan, held = acquire.acquire(DistConfig(gpus="auto:2"), os.environ)  # the claim still counts
        with held:
            assert 2 not in plan.physical_ids
    finally:
        for fd in fds:
            os.close(fd)


def test_a_huge_holder_file_is_read_only_in_part(fake_gpus):
    fds = live_claim(UUID(1), b"")
    os.truncate(claims_dir() / f"{UUID(1)}.{os.geteuid()}.holder", 2**40)  # sparse: 1 TiB of zeros
    try:
        start = time.monotonic()
        assert claimed()[UUID(1)].describe() == "an unknown job (its holder file is unreadable)"
        assert time.monotonic() - start < 10
    finally:
        for fd in fds:
            os.close(fd)


def test_symlinks_and_fifos_are_never_followed_nor_opened_blocking(fake_gpus, tmp_path):
    folder = claims_dir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, folder / f"{UUID(2)}.lock")
    os.mkfifo(folder / f"{UUID(3)}.lock")  # opening a FIFO for reading blocks without O_NONBLOCK
    os.symlink(victim, folder / f"{UUID(1)}.{os.geteuid()}.holder")  # where this user's holder file goes
    found = claimed()
    assert (
        found[UUID(2)].describe()
        == f"an unknown job ({UUID(2)}.lock in the claims folder is a symlink, which is never followed)"
    )
    assert found[UUID(3)].describe() == f"an unknown job ({UUID(3)}.lock in the claims folder is not a regular file)"
    with pytest.raises(GpusTaken, match=r"GPU 2 is claimed by an unknown job \(.*symlink.*; GPU 3 is claimed by an"):
        acquire.acquire(DistConfig(gpus="auto:3"), os.environ)
    plan, held = acquire.acquire(DistConfig(gpus="auto:2"), os.environ)
    with held:
        assert plan.physical_ids == [0, 1]
    assert victim.read_text() == "precious" and os.path.islink(folder / f"{UUID(1)}.{os.geteuid()}.holder")


def test_a_stale_claim_of_a_dead_job_on_a_reused_pid_is_free(fake_gpus):
    folder = claims_dir()
    (folder / f"{UUID(2)}.lock").write_bytes(b"")
    record = {"pid": os.getpid(), "command": "ignite-mgpu train --gpus 2", "since": time.time() - 86400}
    (folder / f"{UUID(2)}.{os.geteuid()}.holder").write_text(json.dumps(record))  # this pid is alive, unlocked
    assert claimed() == {}
    plan, held = acquire.acquire(DistConfig(gpus="2"), os.environ)
    with held:
        assert plan.physical_ids == [2]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a file of another uid")
def test_files_of_another_user_are_never_written(fake_gpus):
    folder = claims_dir()
    lock, holder = folder / f"{UUID(2)}.lock", folder / f"{UUID(2)}.{os.geteuid()}.holder"
    lock.write_bytes(b"theirs")
    holder.write_bytes(b"also theirs")  # named as this user's holder file, but owned by someone else
    for path in (lock, holder):
        os.chown(path, 12345, 12345)
        path.chmod(0o644)
    plan, held = acquire.acquire(DistConfig(gpus="2"), os.environ)  # their lock file can still be flocked
    with held:
        assert plan.physical_ids == [2]
        assert lock.read_bytes() == b"theirs" and holder.read_bytes() == b"also theirs"
        assert claimed()[UUID(2)].describe() == "an unknown job (it wrote no readable holder file)"


@pytest.mark.parametrize("make", ["symlink", "file", "open"])
def test_an_unsafe_claims_folder_is_refused_and_devices_still_answers(fake_gpus, tmp_path, monkeypatch, make):
    path = tmp_path / "claims"
    if make == "symlink":
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
        why = "it is a symlink, which is never followed"
    elif make == "file":
        path.write_text("")
        why = "Not a directory"
    else:
        path.mkdir()
        path.chmod(0o777)  # writable by everyone, not sticky: anyone could delete a claim
        why = "it is writable by other users but not sticky, so any of them could delete a claim"
    monkeypatch.setenv(claims.CLAIMS_DIR_ENV, str(path))
    with pytest.raises(ConfigError, match=rf"^the GPU claims folder {path} cannot be used: {why}\. .* Set "
                       r"IGNITE_MGPU_CLAIMS_DIR to a folder every user of this machine can write, made like /tmp "
                       r"\(mkdir -m 1777 DIR\), or pass --share to run without claims\.$"):  # fmt: skip
        acquire.acquire(DistConfig(gpus="2"), os.environ)
    result = CliRunner().invoke(main, ["devices"])
    assert result.exit_code == 0 and f"Claims not shown: the GPU claims folder {path} cannot be used" in result.output
    assert acquire.acquire(DistConfig(gpus="2", share=True), os.environ)[0].physical_ids == [2]


def test_forged_and_dead_tickets_hold_no_place_in_the_queue(fake_gpus):
    folder = claims_dir()
    import fcntl

    fds = []
    for name, content in [
        ("wait-1-1-12345", b'{"wants": null}'),  # names another uid than its owner's
        (f"wait-2-1-{os.geteuid()}", b"garbage"),  # live but unreadable
        (f"wait-3-1-{os.geteuid()}", b'{"wants": null}'),  # well formed but dead (unlocked)
    ]:
        (folder / name).write_bytes(content)
        if "3-1" not in name:
            fds.append(os.open(folder / name, os.O_RDONLY))
            fcntl.flock(fds[-1], fcntl.LOCK_EX)
    os.mkfifo(folder / "wait-4-1-0")
    try:
        start = time.monotonic()
        plan, held = acquire.acquire(DistConfig(gpus="auto:2", wait=30.0), os.environ)
        with held:
            assert plan.physical_ids == [2, 3] and time.monotonic() - start < 10
        assert not (folder / f"wait-3-1-{os.geteuid()}").exists()  # this user's dead ticket is removed
    finally:
        for fd in fds:
            os.close(fd)


# --- who holds what -----------------------------------------------------------------------------------------------


def test_devices_shows_the_claims_and_the_users_of_the_processes(fake_gpus):
    (fake_gpus / "gpus.csv").write_text(TABLE)
    (fake_gpus / "apps.csv").write_text(f"00000000:07:00.0, {os.getpid()}\n00000000:0F:00.0, 999999999\n")
    me = holders.process_user(os.getpid())
    with hold_here(2, 3):
        table = CliRunner().invoke(main, ["devices"]).output
        data = json.loads(CliRunner().invoke(main, ["devices", "--json"]).output)
    rows = table.splitlines()
    assert " ".join(rows[0].split()).endswith("Util Procs Claimed by CUDA index")
    assert f"1 ({me})" in rows[1] and "1 (?)" in rows[2]
    assert f"{me} (pid {os.getpid()})" in rows[3] and rows[1].split()[-2] == "-"
    assert re.search(rf"^GPU 2 is claimed by {me} \(pid {os.getpid()}, `[^`]+`, since [-0-9: ]+\)\.$", table, re.M)
    gpu2 = data["gpus"][2]
    assert gpu2["uuid"] == UUID(2) and gpu2["claim"]["user"] == me and gpu2["claim"]["pid"] == os.getpid()
    assert gpu2["claim"]["known"] and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", gpu2["claim"]["since"])
    assert data["gpus"][0]["process_users"] == {str(os.getpid()): me} and data["gpus"][0]["claim"] is None
    assert data["gpus"][1]["process_users"] == {"999999999": "?"}


# --- the settings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dist, message",
    [
        (DistConfig(wait=0.0), r"config key 'dist.wait' = 0.0 is invalid: use seconds > 0, .inf \(no limit\) or null"),
        (DistConfig(wait=math.nan), r"config key 'dist.wait' = nan is invalid"),
        (DistConfig(min_free_memory=1.5), r"'dist.min_free_memory' = 1.5 is invalid: use a share of the GPU's memory"),
        (DistConfig(share=True, wait=5.0), r"^--share runs beside the other jobs' claims and --wait waits for them"),
    ],
)
def test_bad_settings_are_refused(dist, message):
    with pytest.raises(ConfigError, match=message):
        validate(Config(dist=dist))


def test_the_wait_flag_alone_has_no_limit_and_a_bad_value_says_where_it_goes(monkeypatch):
    seen = []
    monkeypatch.setattr("ignite_mgpu.jobs.fit", lambda cfg: seen.append(cfg.dist) or 0)
    for args in (["--wait"], ["--wait", "90", "--gpus", "2"], ["--share"], []):
        assert CliRunner().invoke(main, ["train", *args]).exit_code == 0
    assert [(d.wait, d.share) for d in seen] == [(math.inf, False), (90.0, False), (None, True), (None, False)]
    bad = CliRunner().invoke(main, ["train", "--wait", "optim.lr=0.1"])
    assert bad.exit_code == 2 and "'optim.lr=0.1' is not a number of seconds > 0. Give --wait alone" in bad.output
    assert "put it after the key=value overrides or before another flag" in bad.output


def test_wait_under_torchrun_is_refused(monkeypatch):
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"^--wait: this process was started by torchrun/SLURM, which own the GPUs"):
        make_plan(DistConfig(wait=60.0))[0]


def test_the_timeout_error_is_a_config_error_with_its_own_code():
    assert issubclass(WaitTimedOut, ConfigError) and WaitTimedOut("x").exit_code == 4
