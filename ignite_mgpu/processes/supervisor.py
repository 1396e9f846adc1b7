"""The process supervisor: one worker per local rank (``worker.worker_main``), forked by the job's fork server
(``forkserver.py``; spawned for a script, forked from a notebook); the first failure or a signal stops them all; a
failure that a restart can cure (``outcome.no_restart_reason``) restarts them, up to ``dist.max_restarts`` times,
at once after one rank's death, else after a backoff. How the job ended is ``outcome.outcome``'s to say."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
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
from typing import Any

from ignite_mgpu.env.clock import JobClock
from ignite_mgpu.errors import DIVERGED, FAILED, SUCCESS, USAGE, ConfigError, signal_exit_code
from ignite_mgpu.processes import elastic, forkserver, torchelastic
from ignite_mgpu.processes.attempt_files import read_failures, read_statuses, read_value
from ignite_mgpu.processes.heartbeat import HangChecks
from ignite_mgpu.processes.outcome import (
    Failure,
    Outcome,
    cut_short_while_saving,
    no_restart_reason,
    outcome,
    refused_start,
    stop_line,
)
from ignite_mgpu.processes.plan import LaunchPlan, Restart, free_port
from ignite_mgpu.processes.resize import Lender, Resizing, lends, with_gpus
from ignite_mgpu.processes.worker import worker_main

# After the first failure the other ranks get this long to exit by themselves (a peer that lost its connection
# does at once; the failing rank's failure file is written by then); longer only while one of them writes a checkpoint.
FAILURE_SETTLE = 1.0
# Seconds before restart k: BACKOFF * 2**(k-1), at most MAX_BACKOFF.
BACKOFF, MAX_BACKOFF = 1.0, 30.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOPPED = signal_exit_code(signal.SIGTERM)  # a worker's code after a stop on SIGTERM (its checkpoint written)


def _print(message: str) -> None:
    if message:
        print(f"ignite-mgpu: {message}", file=sys.stderr, end="" if message.endswith("\n") else "\n", flush=True)


class Supervisor:
    """Starts the workers, watches them, stops them all on the first failure or a signal, and restarts them up to
    ``plan.max_restarts`` times after a failure a restart can cure (``restart`` gives each restart's arguments).

    After ``run``, ``outcome`` says how the job ended and ``value`` holds what ``fn`` returned on global rank 0
    (None: it returned nothing, or the job failed). ``report=False``: the caller reports the ending (a notebook's
    exception) instead of the last lines on stderr."""

    def __init__(
        self,
        plan: LaunchPlan,
        fn: Callable[..., Any],
        args: tuple,
        restart: Callable[[int], Restart] | None = None,
        report: bool = True,
    ) -> None:
        self.plan, self.fn, self.args, self.restart, self.report = plan, fn, args, restart, report
        self.outcome, self.value, self.note = Outcome(SUCCESS), None, ""
        self.error_dir = ""  # the job's private folder, made by run() and removed when it ends
        self.signal_received = 0
        self.starting = False  # while the attempt's workers are being started
        # The stop signal came then: _attempt kills what it started.
        self.stopped_while_starting = False
        self.procs: list[Any] = []
        # (local rank, exit code) of the first rank that failed.
        self.first_failure: tuple[int, int] | None = None
        # Local ranks killed by a signal before this process signalled any.
        self.died: list[int] = []
        self.signalled = False  # whether this process has signalled the attempt's workers
        # The fork server's pid, once started (it outlives the attempts)
        self.server: int | None = None
        self.deadline = self.failure_deadline = self.failure_time = float("inf")
        self.failed_at: float | None = None  # time.time() of the attempt's first failure
        self.cut_short = False  # a stop ended at once: a second signal, or the stop's grace ran out
        # The attempt's hang watch, and its report of where every rank was (heartbeat.py)
        self.hangs = HangChecks(plan, Path(self.error_dir))
        # The next attempt's anchors: a restart adds the failure's time and progress.
        self.clock = plan.clock
        self.failures: list[Failure] = []  # the failure files of the last attempt's ranks
        self.gpu_line = ""  # a failed GPU left out of the coming restart (elastic.py), said with it
        # An elastic job's looks at the waiting line (resize.py), and the change of size under way.
        self.lender = Lender(plan) if lends(plan, restart is not None) else None
        self.resizing: Resizing | None = None

    def _signal_all(self, sig: int) -> None:
        self.signalled = True
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
            self.cut_short = True
            self._signal_all(signal.SIGKILL)
            raise KeyboardInterrupt
        self.signal_received = signum
        self.stopped_while_starting = self.starting
        # While starting, _attempt kills what it started: no worker of this attempt has begun.
        _print(stop_line(signum, self.plan.join_group, self.plan.stop_grace, self.starting))
        # The pre-emption signal is passed on as it is: every rank must stop for the same reason (its exit code); the
        # default job's workers stop on SIGTERM (their SIGINT is ignored: a terminal's Ctrl-C is the launcher's).
        preempt = signum not in _STOP_SIGNALS
        self._signal_all(signum if preempt or not self.plan.join_group else signal.SIGTERM)
        self.deadline = time.monotonic() + self.plan.stop_grace

    def run(self) -> int:
        plan = self.plan
        # 0700: private to this user; named by this pid for `ignite-mgpu stacks PID` (processes/stacks.py)
        self.error_dir = tempfile.mkdtemp(prefix=f"ignite-mgpu-{os.getpid()}-")
        handled = [*_STOP_SIGNALS, *([plan.preempt_signal] if plan.preempt_signal else [])]
        old = {s: signal.signal(s, self._on_signal) for s in handled}
        # attempt: every start of the workers; restarts: those after a failure (a change of size is not one)
        args, attempt, restarts, result, note = self.args, 0, 0, Outcome(SUCCESS), ""
        try:
            while True:
                result, reason, reached = self._attempt(attempt, args, restarts)
                attempt += 1
                if self.resizing is not None and (resized := self._resized(result, restarts)) is not None:
                    args = resized
                    continue
                if reason is None and restarts < plan.max_restarts:
                    reason = self._leave_out_failed_gpus()
                if reason is not None or restarts >= plan.max_restarts:
                    if plan.max_restarts and result.code in (FAILED, DIVERGED):
                        why = f"not restarted: {reason}" if reason else f"gave up after {restarts} restart(s)"
                        note = f"{why} (dist.max_restarts={plan.max_restarts})."
                    break
                restarts += 1
                args = self._announce_restart(restarts, result, reached)
                if self.signal_received:
                    name = signal.Signals(self.signal_received).name
                    result = Outcome(signal_exit_code(self.signal_received), f"stopped by {name} before a restart.")
                    break
        except KeyboardInterrupt:  # a second signal during the backoff
            result = Outcome(signal_exit_code(self.signal_received or signal.SIGINT), "stopped before a restart.")
        finally:
            self._signal_all(signal.SIGKILL)
            if self.server is not None:
                forkserver.stop()
            for s, h in old.items():
                signal.signal(s, h)
            shutil.rmtree(self.error_dir, ignore_errors=True)
        self.outcome, self.note = result, note
        if self.report:
            _print(result.message())
            _print(note)
        return result.code

    def _attempt(self, attempt: int, args: tuple, restarts: int) -> tuple[Outcome, str | None, int]:
        """Start every worker, watch them, stop them all. Returns how they ended, why a restart cannot cure it
        (None: it can), and the last iteration that every rank had completed. ``restarts``: after failures, what
        the workers count (TORCHELASTIC_RESTART_COUNT)."""
        plan = dataclasses.replace(self.plan, clock=self.clock)
        folder = Path(self.error_dir, f"attempt{attempt}")
        folder.mkdir()
        # No TCP port at all; a fresh store for every attempt.
        if plan.nnodes == 1 and plan.master_port is None:
            plan.rendezvous_file = os.path.join(self.error_dir, "rendezvous" + (str(attempt) if attempt else ""))
            if not plan.join_group:
                # A script rendezvous through MASTER_PORT (env://): a port free now, a fresh one for every attempt.
                plan = dataclasses.replace(plan, master_port=free_port(plan.master_addr))
        self.procs, self.first_failure, self.died, self.signalled = [], None, [], False
        self.hangs = HangChecks(plan, folder)
        self.deadline = self.failure_deadline = self.failure_time = float("inf")
        self.failed_at = None
        refused = None
        try:
            self.starting = True
            refused = self._start_all(plan, args, str(folder), restarts)
            self.starting = False
            # Stopped while the workers started (the first waits for the fork server's imports): none has begun,
            # and one started after the signal never got it.
            if self.stopped_while_starting:
                self._signal_all(signal.SIGKILL)
            if refused is None:
                self._watch(folder)
        except KeyboardInterrupt:
            pass
        finally:
            self.starting = False
            self._signal_all(signal.SIGKILL)
            for p in self.procs:
                p.join(5)
        if refused is not None:  # no restart: the machine would refuse it again
            return refused, refused.cause, 0
        exit_codes = [p.exitcode for p in self.procs]
        reached = min((status[0] for status in read_statuses(folder)), default=0)
        if self.resizing is not None and exit_codes and set(exit_codes) == {STOPPED} and not self.signal_received:
            self.clock = JobClock(plan.clock.started, time.time(), reached)  # stopped for a change of size
            return Outcome(STOPPED), None, reached
        offset = plan.node_rank * plan.nproc
        failed_ranks = [offset + i for i, code in enumerate(exit_codes) if code]
        failures = self.failures = torchelastic.with_error_files(read_failures(folder), folder, failed_ranks)
        result = outcome(failures, exit_codes, self.first_failure, self.signal_received, offset, plan.timeout)
        result = cut_short_while_saving(result, self.cut_short and any(s[1] for s in read_statuses(folder)))
        reason = no_restart_reason(failures, exit_codes, self.first_failure, self.signal_received)
        result = self.hangs.outcome(result, bool(self.signal_received))  # where every rank was, if it hung
        if self.died == [self.first_failure[0] if self.first_failure else -1] and result.rank is not None:
            # One rank's death: its first restart need not wait.
            result = dataclasses.replace(result, died=True)
        failed_at = self.failed_at if self.failed_at is not None else time.time()
        # Used only if the job restarts.
        self.clock = JobClock(plan.clock.started, failed_at, reached)
        self.value = read_value(folder) if result.code == SUCCESS else None
        return result, reason, reached

    def _start_all(self, plan: LaunchPlan, args: tuple, folder: str, attempt: int) -> Outcome | None:
        """Start the attempt's workers (no more once a stop signal came); an Outcome when the machine refused one."""
        for local_rank in range(plan.nproc):
            if self.signal_received:
                break  # stopped while starting: start no more workers
            try:
                self.procs.append(self._start(plan, local_rank, args, folder, attempt))
            # EAGAIN or ENOMEM from fork (ulimit -u, memory); EOFError: the fork server died of it before it answered.
            except (OSError, EOFError) as err:
                if isinstance(err, OSError) and err.errno not in (errno.EAGAIN, errno.ENOMEM):
                    raise
                return Outcome(USAGE, refused_start(local_rank, plan.nproc, err))
        return None

    def _start(self, plan: LaunchPlan, local_rank: int, args: tuple, folder: str, attempt: int) -> Any:
        """Start one worker: forked by the fork server (started at the first attempt, kept for the restarts; the
        worker gets this process's environment, which the server lacks), or spawned or forked from here."""
        ctx: Any = mp.get_context(plan.start_method)  # every context has Process
        parent, environ = os.getpid(), None
        if plan.start_method == forkserver.METHOD:
            parent = self.server = forkserver.start(forkserver.preload_for(self.fn, args), plan.preempt_signal)
            environ = dict(os.environ)
        p = ctx.Process(
            target=worker_main,
            args=(local_rank, plan, self.fn, args, folder, attempt, parent, environ),
            name=f"ignite-mgpu-rank{local_rank}",
        )
        p.start()
        return p

    def _leave_out_failed_gpus(self) -> str | None:
        """Before a restart: a GPU of the job that failed is left out (``elastic.leave_out``); returns why the job
        cannot restart (None: it can)."""
        change = elastic.leave_out(self.plan, self.failures)
        if change is None:
            return None
        # Said after the failure, with the restart; a refusal is said as why the job was not restarted.
        self.gpu_line = change.line if change.refusal is None else ""
        if change.plan is not None:
            self.plan.claims.release(change.released)
            if self.lender is not None:
                self.lender.failed.update(change.released)
            # Goodput counts the restart as a change of size.
            self.clock = dataclasses.replace(self.clock, resized_from=self.plan.world_size)
            self.plan = change.plan
        return change.refusal

    def _announce_restart(self, attempt: int, failure: Outcome, reached: int) -> tuple:
        """Report the failure once and what the restart resumes from; wait the backoff. Returns the new args."""
        plan = self.plan
        info = self.restart(attempt) if self.restart is not None else Restart(self.args, resumes=False)
        # One rank's death (the OOM killer, a lost node's process) restarts at once; a failure that comes back
        # (and every other failure) backs off, so that a failing job does not restart in a tight loop.
        delay = 0.0 if attempt == 1 and failure.died else min(MAX_BACKOFF, BACKOFF * 2 ** (attempt - 1))
        if not info.resumes:
            where = f"running {info.name} again from its start"
        elif info.checkpoint:
            where = f"resuming from {info.checkpoint} at iteration {info.iteration}"
        else:
            where = "from the beginning (no complete checkpoint yet)"
        lost = f"; {max(0, reached - info.iteration)} iteration(s) lost (every rank had completed iteration {reached})"
        _print(failure.message(advice=False))
        _print(self.gpu_line)
        self.gpu_line = ""
        after = f" after {failure.failed} failed" if failure.failed else ""
        _print(
            f"restart {attempt} of {plan.max_restarts} (dist.max_restarts){after}, "
            f"{'at once (one rank died)' if attempt == 1 and failure.died else f'in {delay:.0f} s'}: {where}"
            f"{lost if info.resumes else ''}."
        )
        end = time.monotonic() + delay
        while time.monotonic() < end and not self.signal_received:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        return info.args

    def _look_at_the_line(self, now: float, folder: Path) -> None:
        """An elastic job, while every rank trains well (each completed an iteration in this attempt, so each has its
        stop handler): a change of size asked for stops every rank at the next check, however long until then (an
        evaluation), each writing the stop's checkpoint; ``_resized`` starts them again on the new GPUs."""
        assert self.lender is not None
        if self.resizing is not None or self.signal_received or self.failure_time != float("inf"):
            return
        if not self.lender.due(now):
            return
        statuses = read_statuses(folder)
        if len(statuses) < len(self.procs) or not all(iteration > 0 for iteration, _ in statuses):
            return
        try:
            self.resizing = self.lender.look(self.plan, now)
        except (ConfigError, OSError) as err:  # the claims folder became unusable: the job keeps its GPUs
            _print(f"no more lending: {err}")
            self.lender = None
            return
        if self.resizing is not None:
            self._signal_all(signal.SIGTERM)

    def _resized(self, result: Outcome, restarts: int) -> tuple | None:
        """After the workers stopped for a change of size: the lent GPUs let go, the plan on the new GPUs, the line
        in the log; returns the restart's arguments (the stop's checkpoint). None: the change did not happen (the
        job ended, failed or was stopped meanwhile); what it took is let go again."""
        resizing, self.resizing = self.resizing, None
        assert resizing is not None and self.lender is not None
        if result.code != STOPPED or self.signal_received:
            self.lender.cancel(self.plan, resizing)
            return None
        self.plan.claims.release(resizing.change.lend)
        info = self.restart(restarts) if self.restart is not None else Restart(self.args)
        where = "from the start (no checkpoint yet)"
        if info.checkpoint:
            where = f"resuming from {info.checkpoint} at iteration {info.iteration}"
        _print(self.lender.line(resizing, self.plan, where))
        self.clock = dataclasses.replace(self.clock, resized_from=self.plan.world_size)
        self.plan = with_gpus(self.plan, resizing.names)
        return info.args

    def _watch(self, folder: Path) -> None:
        alive = {p.sentinel: p for p in self.procs}
        while alive:
            soonest = min(self.failure_deadline, self.deadline) - time.monotonic()
            ended = [alive.pop(sentinel) for sentinel in wait(list(alive), timeout=min(0.5, max(0.05, soonest)))]
            for p in ended:
                p.join()
            # Seen together, a rank killed by a signal comes first: its peers' errors (a closed connection) follow it.
            for p in sorted(ended, key=lambda p: p.exitcode >= 0):
                if self.resizing is not None and p.exitcode == STOPPED:
                    continue  # stopped for a change of size, its checkpoint written
                if p.exitcode < 0 and not self.signalled:
                    self.died.append(self.procs.index(p))
                if p.exitcode != 0 and self.first_failure is None:
                    self.first_failure = (self.procs.index(p), p.exitcode)
                if p.exitcode != 0 and not self.signal_received and self.failure_time == float("inf"):
                    # One rank failed: the others cannot finish. With gloo their next collective fails at once
                    # ("Connection closed by peer") and they exit by themselves; NCCL may hang. They get a short
                    # settle time, and longer only while one writes a checkpoint (it is of a good iteration).
                    self.failure_time, self.failed_at = time.monotonic(), time.time()
                    self.failure_deadline = self.failure_time + FAILURE_SETTLE
            now = time.monotonic()
            if alive and self.lender is not None:
                self._look_at_the_line(now, folder)
            if alive and self.failure_time == float("inf") and self.hangs.hung(len(self.procs), now):
                self._signal_all(signal.SIGKILL)  # every rank's stacks are in the hang's report
            if alive and now > self.failure_deadline:
                living = [self.plan.node_rank * self.plan.nproc + self.procs.index(p) for p in alive.values()]
                # A dead rank's flag is stale.
                saving = any(status[1] for status in read_statuses(folder, living))
                if not saving or now > self.failure_time + self.plan.stop_grace:
                    self.hangs.after_failure(self.first_failure, read_failures(folder))
                    self._signal_all(signal.SIGKILL)
                    self.failure_deadline = float("inf")
            if now > self.deadline:
                print(
                    f"ignite-mgpu: workers did not stop within {self.plan.stop_grace:.0f} s; killing them.",
                    file=sys.stderr,
                )
                self.cut_short = True
                self.hangs.after_stop()
                self._signal_all(signal.SIGKILL)
                self.deadline = float("inf")
