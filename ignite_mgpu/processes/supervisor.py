"""The supervisor: a job's loop over its attempts. It runs an attempt (``attempt.py``: one start of the workers, to
how they ended), then decides the next start from how it ended (``next_start.decide_next``): the job is done, it
restarts after a failure that a restart can cure (up to ``dist.max_restarts`` times, after a backoff), or it goes
on on other GPUs (an elastic job: a failed GPU left out, GPUs lent or taken back). It holds what lasts for the
whole job: the stop signals, the fork server, the GPU claims and an elastic job's looks at the waiting line."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ignite_mgpu.env import launcher_dir, stop
from ignite_mgpu.env.clock import JobClock, first_attempt
from ignite_mgpu.errors import SUCCESS, ConfigError, signal_exit_code
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.processes import elastic, forkserver
from ignite_mgpu.processes.attempt import Attempt, Ended
from ignite_mgpu.processes.attempt_files import read_statuses
from ignite_mgpu.processes.elastic import Lender, Resize
from ignite_mgpu.processes.job import Job, Restart
from ignite_mgpu.processes.machine import free_port
from ignite_mgpu.processes.next_start import NextStart, decide_next, resize_where, restart_messages
from ignite_mgpu.processes.outcome import Outcome, stop_message
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.processes.worker import WorkerSpec

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _print(message: str) -> None:
    if message:
        print(f"ignite-mgpu: {message}", file=sys.stderr, end="" if message.endswith("\n") else "\n", flush=True)


class Supervisor:
    """Runs ``job`` as ``plan`` says, attempt after attempt; ``restart(k)`` gives restart k's arguments and where
    it resumes (None: the job runs again from its start). ``claims``: the job's GPU claims, which an elastic job
    changes; ``run_dir``: where a hang's report goes.

    After ``run``, ``outcome`` says how the job ended, ``note`` why it was not restarted, and ``value`` holds what
    the job's function returned on global rank 0 (None: it returned nothing, or the job failed). ``report=False``:
    the caller reports the ending (a notebook's exception) instead of the last lines on stderr."""

    def __init__(
        self,
        plan: LaunchPlan,
        job: Job,
        claims: GpuClaims | None = None,
        restart: Callable[[int], Restart] | None = None,
        report: bool = True,
        run_dir: str | None = None,
    ) -> None:
        self.plan = plan  # the plan of the attempt that runs now, or ran last
        self.job = job
        self.restart = restart
        self.report = report
        self.run_dir = run_dir
        self.ended = Ended(Outcome(SUCCESS))
        self.note = ""
        self.signal_received = 0
        self.signal_at = 0.0  # time.monotonic() when it came
        self.attempt: Attempt | None = None  # the attempt that runs now, or ran last
        held = claims if claims is not None else GpuClaims()
        lends = elastic.lends(plan, held, restart is not None)
        self.lender = Lender(held, str(plan.gpu_range)) if lends else None
        self.resize: Resize | None = None  # an elastic job's change of size under way
        self.claims = held

    @property
    def outcome(self) -> Outcome:
        return self.ended.outcome

    @property
    def value(self) -> Any:
        return self.ended.value

    def run(self) -> int:
        """Run the job to its end; returns its exit code (errors.EXIT_CODES)."""
        # The folders that killed launchers of this user left behind go first.
        launcher_dir.remove_dead()
        # 0700, named by this pid and held open: `ignite-mgpu stacks PID` trusts only such a folder (hangs/stacks.py)
        folder, held = launcher_dir.make()
        handled = [*_STOP_SIGNALS, *([self.plan.preempt_signal] if self.plan.preempt_signal else [])]
        old = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            self.ended, self.note = self._attempts(folder)
        except KeyboardInterrupt:  # a second signal during the backoff
            stopped = Outcome(signal_exit_code(self.signal_received or signal.SIGINT), "stopped before a restart.")
            stopped.advice = self._resume_hint()
            self.ended, self.note = Ended(stopped), ""
        finally:
            if self.attempt is not None:
                self.attempt.kill()
            if self.plan.start_method == forkserver.METHOD:
                forkserver.stop()
            for s, h in old.items():
                signal.signal(s, h)
            launcher_dir.remove(folder, held)
        if self.report:
            _print(self.outcome.message())
            _print(self.note)
        return self.outcome.code

    def _attempts(self, folder: Path) -> tuple[Ended, str]:
        """The job's loop: an attempt, then the next start decided from how it ended, until the job ends."""
        plan, job = self.plan, self.job
        restarts = 0  # after a failure: what the workers count (TORCHELASTIC_RESTART_COUNT)
        clock = first_attempt()
        for index in itertools.count():
            self.plan = plan
            spec = WorkerSpec(plan, job, str(folder / f"attempt{index}"), clock, restarts)
            ended = self._run_attempt(spec, index)
            resized, self.resize = self.resize, None
            if resized is not None and not ended.resized and self.lender is not None:
                self.lender.cancel(resized)  # the change did not happen: what it took goes back
            next_start = decide_next(ended, plan, restarts, resized)
            if next_start.plan is None:
                return ended, next_start.note
            self.claims.release(next_start.release)
            if self.lender is not None:
                self.lender.failed.update(next_start.failed)
            args = self._announce(next_start, ended, resized, restarts)
            if self.signal_received and next_start.restarts > restarts:  # stopped during the restart's backoff
                name = signal.Signals(self.signal_received).name
                stopped = Outcome(signal_exit_code(self.signal_received), f"stopped by {name} before a restart.")
                stopped.advice = self._resume_hint()
                return Ended(stopped), ""
            clock = JobClock(clock.started, ended.failed_at, ended.reached, next_start.resized_from)
            plan = next_start.plan
            job = job.again(args)
            restarts = next_start.restarts
        raise AssertionError("unreachable")

    def _resume_hint(self) -> str:
        """The way on after a stop between attempts, for a job that resumes its checkpoints (a restart hook)."""
        return "--resume auto continues from the last complete checkpoint." if self.restart is not None else ""

    def _run_attempt(self, spec: WorkerSpec, index: int) -> Ended:
        """One attempt, with its private rendezvous on one node (a fresh file store every time; a script's
        env:// rendezvous on a port free now)."""
        plan = spec.plan
        if plan.nnodes == 1 and plan.master_port is None:
            rendezvous = os.path.join(Path(spec.folder).parent, "rendezvous" + (str(index) if index else ""))
            port = None if plan.join_group else free_port(plan.master_addr)
            spec = WorkerSpec(spec.plan, spec.job, spec.folder, spec.clock, spec.restarts, rendezvous, port)
        Path(spec.folder).mkdir()
        self.attempt = Attempt(spec, index, self.run_dir, self.signal_received)
        return self.attempt.run(self._look if self.lender is not None else None)

    def _announce(self, start: NextStart, ended: Ended, resized: Resize | None, restarts: int) -> tuple:
        """Say what the next start is, wait a restart's backoff; returns the next start's arguments of the job."""
        if start.restarts == restarts:  # a change of size, after every rank stopped with its checkpoint
            assert resized is not None and self.lender is not None
            info = self.restart(restarts) if self.restart is not None else Restart(self.job.args)
            _print(self.lender.message(resized, self.plan, resize_where(info)))
            return info.args
        k = start.restarts
        info = self.restart(k) if self.restart is not None else Restart(self.job.args, resumes=False)
        for message in restart_messages(start, ended.outcome, info, ended.reached, self.plan.max_restarts):
            _print(message)
        end = time.monotonic() + start.delay
        while time.monotonic() < end and not self.signal_received:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        return info.args

    def _on_signal(self, signum: int, frame: Any) -> None:
        attempt, now = self.attempt, time.monotonic()
        if self.signal_received:
            # GNU timeout sends its signal to this process, then to its process group: one request, received twice.
            if stop.same_request(self.signal_received, self.signal_at, signum, now):
                return
            if attempt is not None:  # a second request: no more waiting
                attempt.kill(cut_short="a second signal")
            raise KeyboardInterrupt
        self.signal_received, self.signal_at = signum, now
        # Before the first attempt started a worker, or while it starts them, the attempt kills what it started: no
        # worker of it has begun.
        starting = attempt is None or attempt.starting or not attempt.procs
        _print(stop_message(signum, self.plan.join_group, self.plan.stop_grace, starting))
        # The pre-emption signal is passed on as it is: every rank must stop for the same reason (its exit code); the
        # default job's workers stop on SIGTERM (their SIGINT is ignored: a terminal's Ctrl-C is the launcher's).
        preempt = signum not in _STOP_SIGNALS
        if attempt is not None:
            attempt.stop(signum, signum if preempt or not self.plan.join_group else signal.SIGTERM)

    def _look(self, attempt: Attempt, now: float) -> None:
        """An elastic job, while every rank trains well (each completed an iteration in this attempt, so each has its
        stop handler): a change of size asked for stops every rank at the next check, however long until then (an
        evaluation), each writing the stop's checkpoint; the next attempt runs on the new GPUs."""
        assert self.lender is not None
        if self.resize is not None or self.signal_received or attempt.failed or not self.lender.due(now):
            return
        statuses = read_statuses(attempt.folder)
        if len(statuses) < len(attempt.procs) or not all(status.iteration > 0 for status in statuses):
            return
        try:
            self.resize = self.lender.look(attempt.spec.plan, now)
        except (ConfigError, OSError) as err:  # the claims folder became unusable: the job keeps its GPUs
            _print(f"no more lending: {err}")
            self.lender = None
            return
        if self.resize is not None:
            attempt.stop_to_resize()
