"""The fault-injection harness for tests/faults: runs the real CLI in its own session with a hard timeout, reads
its output continuously, samples its process tree (and LISTEN sockets) every 0.1 s, and checks afterwards that no
process of the job outlived it. Used by test_faults.py; faults are injected by faultmod.py."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

FAULTS_DIR = Path(__file__).resolve().parent
REPO = FAULTS_DIR.parents[1]  # the checkout these tests belong to
CLI = [sys.executable, "-m", "ignite_mgpu"]
# Variables that would make the launcher think torchrun/SLURM started it.
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_SLURM_ENV = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_NTASKS_PER_NODE")


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    elapsed: float  # seconds from start to exit

    def __str__(self) -> str:
        return f"exit {self.rc} after {self.elapsed:.1f} s\n--- stderr (tail) ---\n{self.stderr[-6000:]}"


def is_alive(pid: int, proc: psutil.Process | None) -> bool:
    """Running and not a zombie (an exited process nobody reaped yet holds nothing but its pid)."""
    try:
        if proc is None:
            os.kill(pid, 0)
            proc = psutil.Process(pid)
        elif not proc.is_running():  # also false when the pid was reused by another process
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
    except PermissionError:
        return True


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


class Job:
    """One CLI process in its own session; output is read continuously, its process tree sampled."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        cwd: Path,
        pids_dir: Path,
        watch_sockets: bool,
        command: list[str] | None = None,
    ) -> None:
        self.args, self.pids_dir, self.watch_sockets = args, pids_dir, watch_sockets
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [*(command or CLI), *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.end: float | None = None  # when the launcher was seen to have exited (monotonic)
        self.last_alive: dict[int, float] = {}  # when each process (not the launcher) was last seen running
        self._stop = False
        self._out: list[str] = []
        self._err: list[str] = []
        self.processes: dict[int, psutil.Process | None] = {}  # every process of the job ever seen
        self.cmdlines: dict[int, str] = {}
        self.listeners: set[tuple[int, str, int]] = set()  # (pid, ip, port) of LISTEN sockets ever seen
        self.socket_samples = 0  # samples in which both ranks' sockets were read
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self._out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self._err), daemon=True),
            threading.Thread(target=self._sample, daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream, sink: list[str]) -> None:  # stream: a text pipe
        for line in iter(stream.readline, ""):
            sink.append(line)

    def _remember(self, pid: int, proc: psutil.Process | None = None) -> None:
        with self._lock:
            if self.processes.get(pid) is None:
                with contextlib.suppress(psutil.Error):
                    proc = proc or psutil.Process(pid)
                    self.cmdlines[pid] = " ".join(proc.cmdline())[:160]
                self.processes[pid] = proc

    def _sample(self) -> None:
        """Every 0.1 s: the launcher's process tree while it runs, then until every process seen is gone (at most
        60 s), when each was last alive; this is what "nothing outlives the job" is judged on."""
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            root = None
        self._remember(self.pid, root)
        while not self._stop:
            now = time.monotonic()
            if self.proc.poll() is None:
                try:
                    kids = root.children(recursive=True) if root else []
                except psutil.Error:
                    kids = []
                for k in kids:
                    self._remember(k.pid, k)
                if self.watch_sockets and root:
                    self._sample_sockets([root, *kids])
            elif self.end is None:
                self.end = now
            alive = [pid for pid, p in self.all_processes().items() if pid != self.pid and is_alive(pid, p)]
            for pid in alive:
                self.last_alive[pid] = now
            if self.end is not None and (not alive or now - self.end > 60):
                return
            time.sleep(0.1)

    def _sample_sockets(self, procs: list[psutil.Process]) -> None:
        seen_ranks = 0
        ranks = {int(pid) for f in self.pids_dir.glob("rank*") for pid in f.read_text().split()}
        for p in procs:
            try:
                conns = p.net_connections(kind="inet")
            except psutil.Error:
                continue
            seen_ranks += p.pid in ranks
            for c in conns:
                if c.status == psutil.CONN_LISTEN:
                    self.listeners.add((p.pid, c.laddr.ip, c.laddr.port))
        if seen_ranks >= 2:
            self.socket_samples += 1

    def recorded_pids(self) -> set[int]:
        """Pids that faultmod wrote: every rank (``rank{r}``) and its children (``children{r}``)."""
        pids: set[int] = set()
        if self.pids_dir.is_dir():
            for f in self.pids_dir.iterdir():
                if f.name.startswith(("rank", "children")):
                    pids |= {int(x) for x in f.read_text().split()}
        return pids

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float, what: str = "") -> Result:
        """Wait until ``timeout`` seconds after the start; past it kill everything and fail the test."""
        try:
            self.proc.wait(timeout=max(0.1, self.start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            time.sleep(0.5)
            pytest.fail(
                f"{what or 'job'} did not exit within {timeout:.0f} s (killed it): {self.args}\n"
                f"--- stderr (tail) ---\n{self.stderr[-6000:]}"
            )
        exited = time.monotonic()
        for t in self._threads[:2]:
            t.join(timeout=5)  # an orphan that keeps the pipes open must not hang the test
        return Result(self.proc.returncode, "".join(self._out), self.stderr, exited - self.start)

    def all_processes(self) -> dict[int, psutil.Process | None]:
        for pid in self.recorded_pids():
            self._remember(pid)
        with self._lock:
            return dict(self.processes)

    def kill_all(self) -> None:
        self._stop = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid, proc in self.all_processes().items():
            if is_alive(pid, proc):
                with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                    (proc or psutil.Process(pid)).kill()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)


class Harness:
    """Starts jobs in one folder (each with its own pids dir and TMPDIR) and checks that nothing outlives them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs: list[Job] = []

    def env(self, tag: str, fault: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV + _SLURM_ENV}
        tmp = self.root / f"tmp-{tag}"
        tmp.mkdir(exist_ok=True)
        env.update(
            # the checkout under test first, as run_cli does: not whichever one the package was installed from
            PYTHONPATH=os.pathsep.join(filter(None, [str(FAULTS_DIR), str(REPO), os.environ.get("PYTHONPATH")])),
            PIDS_DIR=str(self.root / f"pids-{tag}"),
            FAULT=fault or "",
            TMPDIR=str(tmp),  # the launcher's private folder (error files, file rendezvous) lands here
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            CUDA_VISIBLE_DEVICES="",  # these are CPU/gloo scenarios, on any machine
        )
        env.update(extra or {})
        return env

    def start(
        self,
        args: list[str],
        fault: str | None = None,
        tag: str = "a",
        watch_sockets: bool = False,
        extra: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> Job:
        """``command`` replaces ``python -m ignite_mgpu`` (e.g. torchrun); ``extra`` adds environment variables
        (SLURM's, which ``env`` removes from the test's own environment)."""
        job = Job(args, self.env(tag, fault, extra), self.root, self.root / f"pids-{tag}", watch_sockets, command)
        self.jobs.append(job)
        return job

    def run(
        self,
        args: list[str],
        timeout: float,
        fault: str | None = None,
        tag: str = "a",
        extra: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> Result:
        return self.start(args, fault, tag, extra=extra, command=command).wait(timeout)

    def assert_no_leftovers(self, grace: float = 3.0) -> None:
        """No process of any job (ranks, DataLoader workers, helpers) ran longer than ``grace`` seconds after
        its launcher exited, and none runs now.

        The launcher joins its ranks before it exits, so when it returns the job should be over; the grace only
        absorbs the kernel finishing the exits on a loaded machine.
        """
        problems = []
        for job in self.jobs:
            while job.end is None and job._threads[2].is_alive():  # the sampler notes the exit within 0.1 s
                time.sleep(0.05)
            end = job.end if job.end is not None else time.monotonic()
            procs = {pid: p for pid, p in job.all_processes().items() if pid != job.pid}
            while time.monotonic() < end + grace and any(is_alive(pid, p) for pid, p in procs.items()):
                time.sleep(0.1)
            for pid, p in procs.items():
                late = job.last_alive.get(pid, 0.0) - end
                if is_alive(pid, p) or late > grace:
                    what = job.cmdlines.get(pid, "?")
                    state = "still alive" if is_alive(pid, p) else f"alive {late:.1f} s after the launcher exited"
                    problems.append(f"pid {pid} {state}: {what}")
        assert not problems, f"processes outlived the job (grace {grace:.0f} s):\n" + "\n".join(problems)

    def cleanup(self) -> None:
        for job in self.jobs:
            job.kill_all()
