"""The process supervisor: one spawned worker per local rank (``worker.worker_main``); the first failure or a
signal stops them all, and ``summarize`` turns how each ended into one exit code and one message."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ignite_mgpu.errors import DIVERGED, FAILED, SUCCESS, signal_exit_code
from ignite_mgpu.worker import worker_main

if TYPE_CHECKING:
    from ignite_mgpu.launcher import LaunchPlan

FAILURE_GRACE = 10.0  # seconds the other ranks get to notice a failed rank before they are killed
_STOPPED = (signal_exit_code(signal.SIGINT), signal_exit_code(signal.SIGTERM))


def summarize(
    reports: list[dict[str, Any]],
    exit_codes: list[int | None],
    first_failure: tuple[int, int] | None = None,
    signal_received: int = 0,
    rank_offset: int = 0,
    timeout: float = 300.0,
) -> tuple[int, str]:
    """The job's exit code and what to tell the user, from how every worker ended.

    Args:
        reports: the error files of the workers that failed (``worker.error_report``).
        exit_codes: every local worker's exit code (negative: killed by that signal).
        first_failure: (local rank, exit code) of the first worker that ended with a non-zero code.
        signal_received: the signal the launcher itself received (0: none).
        rank_offset: the global rank of local rank 0 (multi-node).
        timeout: ``dist.timeout``, named in the message for a collective that timed out.
    """
    stopped = [r for r in reports if r["code"] in _STOPPED]
    if signal_received:
        # The workers were told with SIGTERM; name the signal the user actually sent.
        name = signal.Signals(signal_received).name
        message = stopped[0]["message"].replace("SIGTERM", name) if stopped else f"stopped by {name}"
        return signal_exit_code(signal_received), f"{message}."
    if all(c == 0 for c in exit_codes):
        return SUCCESS, ""
    if len(stopped) == len(exit_codes):  # every worker was signalled directly (e.g. by a scheduler)
        return int(stopped[0]["code"]), f"{stopped[0]['message']}."
    diverged = [r for r in reports if r["code"] == DIVERGED]
    if diverged:
        return DIVERGED, f"training diverged: {diverged[0]['message']}"
    if first_failure and first_failure[1] == -signal.SIGABRT and not reports:
        # NCCL's watchdog aborts a process whose collective outlived the timeout (no error file is written): the
        # ranks that aborted were waiting; the silent ones, those that did not abort, are what to look at.
        aborted = [rank_offset + i for i, c in enumerate(exit_codes) if c == -signal.SIGABRT]
        silent = [rank_offset + i for i, c in enumerate(exit_codes) if c != -signal.SIGABRT]
        return FAILED, (
            f"rank(s) {', '.join(map(str, aborted))} aborted (SIGABRT), which is how NCCL's watchdog ends a "
            f"process whose collective waited longer than dist.timeout ({timeout:.0f} s); rank(s) "
            f"{', '.join(map(str, silent)) or '?'} never arrived (stuck or hung). Find what they were doing (data "
            "loader, I/O, a rank-dependent branch); --resume auto continues from the last checkpoint."
        )
    if first_failure and first_failure[1] < 0:  # killed (OOM killer, kill -9): no error file of its own
        local_rank, code = first_failure
        hint = " (the kernel's OOM killer sends SIGKILL when memory runs out)" if code == -signal.SIGKILL else ""
        return FAILED, (
            f"rank {rank_offset + local_rank} terminated with signal {signal.Signals(-code).name}{hint}; stopped "
            "the other ranks. Resume from the last checkpoint with --resume auto."
        )
    failed = [r for r in reports if r["code"] == FAILED]
    timeouts = [r for r in failed if "timed out" in r["message"].lower() or "timeout" in r["type"].lower()]
    if failed and len(timeouts) == len(failed):
        waiting = {r["rank"] for r in timeouts}
        silent = [rank_offset + i for i in range(len(exit_codes)) if rank_offset + i not in waiting]
        first = min(timeouts, key=lambda r: r["time"])
        return FAILED, (
            f"rank {first['rank']} timed out after {timeout:.0f} s (dist.timeout) waiting in a collective; "
            f"rank(s) {', '.join(map(str, silent)) or '?'} stopped answering (stuck or hung). "
            f"Error: {first['message'].splitlines()[0] if first['message'] else ''}"
        )
    if failed:
        # The earliest error is the cause; later ones are usually peers losing their connection to it.
        first = min(failed, key=lambda r: r["time"])
        return FAILED, f"rank {first['rank']} failed with {first['type']}: {first['message']}\n{first['traceback']}"
    return FAILED, f"a rank exited with codes {exit_codes}."


class Supervisor:
    """Starts the workers, watches them, stops them all on the first failure or a signal."""

    def __init__(self, plan: LaunchPlan, fn: Callable[..., Any], args: tuple) -> None:
        self.plan, self.fn, self.args = plan, fn, args
        self.error_dir = tempfile.mkdtemp(prefix="ignite-mgpu-")  # 0700: private to this user
        self.signal_received = 0
        self.procs: list[Any] = []
        self.first_failure: tuple[int, int] | None = None  # (local rank, exit code) of the first rank that failed

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if not p.pid:
                continue
            if sig == signal.SIGKILL:
                # The worker's group holds its data-loader workers, and outlives a worker that already exited
                # (os._exit leaves them orphaned until their watchdog notices, about 5 s later).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, sig)  # also before the worker made its own group

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signal_received:  # second signal: no more waiting
            self._signal_all(signal.SIGKILL)
            raise KeyboardInterrupt
        self.signal_received = signum
        print(
            f"ignite-mgpu: {signal.Signals(signum).name} received: stopping every rank at the next check "
            f"(up to {self.plan.stop_grace:.0f} s); press Ctrl-C again to stop at once.",
            file=sys.stderr,
        )
        self._signal_all(signal.SIGTERM)
        self.deadline = time.monotonic() + self.plan.stop_grace

    def run(self) -> int:
        ctx = mp.get_context("spawn")
        plan = self.plan
        if plan.nnodes == 1 and plan.master_port is None:
            plan.init_method = "file://" + os.path.join(self.error_dir, "rendezvous")  # no TCP port at all
        self.deadline = float("inf")
        self.failure_deadline = float("inf")
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for local_rank in range(plan.nproc):
                if self.signal_received:
                    break  # stopped while starting: start no more workers
                p = ctx.Process(
                    target=worker_main,
                    args=(local_rank, plan, self.fn, self.args, self.error_dir),
                    name=f"ignite-mgpu-rank{local_rank}",
                )
                p.start()
                self.procs.append(p)
            self._watch()
        except KeyboardInterrupt:
            pass
        finally:
            self._signal_all(signal.SIGKILL)
            for p in self.procs:
                p.join(5)
            for s, h in old.items():
                signal.signal(s, h)
        code, message = summarize(
            self._read_reports(),
            [p.exitcode for p in self.procs],
            self.first_failure,
            self.signal_received,
            plan.node_rank * plan.nproc,
            plan.timeout,
        )
        if message:
            print(f"ignite-mgpu: {message}", file=sys.stderr, end="" if message.endswith("\n") else "\n")
        shutil.rmtree(self.error_dir, ignore_errors=True)
        return code

    def _watch(self) -> None:
        alive = {p.sentinel: p for p in self.procs}
        while alive:
            for sentinel in wait(list(alive), timeout=0.5):
                p = alive.pop(sentinel)
                p.join()
                if p.exitcode != 0 and self.first_failure is None:
                    self.first_failure = (self.procs.index(p), p.exitcode)
                if p.exitcode != 0 and not self.signal_received and self.failure_deadline == float("inf"):
                    # One rank failed: the others cannot finish. With gloo their next collective fails at once
                    # ("Connection closed by peer") and they exit by themselves, after a checkpoint they are
                    # writing has landed; whatever still runs after the grace (NCCL may hang) is killed.
                    self.failure_deadline = time.monotonic() + FAILURE_GRACE
            if time.monotonic() > self.failure_deadline:
                self._signal_all(signal.SIGKILL)
                self.failure_deadline = float("inf")
            if time.monotonic() > self.deadline:
                print(
                    f"ignite-mgpu: workers did not stop within {self.plan.stop_grace:.0f} s; killing them.",
                    file=sys.stderr,
                )
                self._signal_all(signal.SIGKILL)
                self.deadline = float("inf")

    def _read_reports(self) -> list[dict[str, Any]]:
        reports = []
        for f in Path(self.error_dir).glob("rank*.json"):
            with contextlib.suppress(ValueError, OSError):
                reports.append(json.loads(f.read_text()))
        return reports
