"""One attempt: one start of a job's workers, from their start to how they ended (``Ended``). An attempt is started
with what its workers get (``worker.WorkerSpec``: the plan, the job, its folder, its clock, the restart count, its
rendezvous) and watches them: the first failure stops them all (after a short settle, longer while one writes a
checkpoint), a stop request gives them ``dist.stop_grace`` to stop by themselves, the hang watch kills a silent
job after taking every rank's stacks. Workers are forked by the job's fork server (``forkserver.py``; spawned for a
script, forked from a notebook). How the job goes on is the supervisor's to decide. Torch-free."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from ignite_mgpu.errors import SUCCESS, USAGE, signal_exit_code
from ignite_mgpu.hangs.watch import HangChecks
from ignite_mgpu.processes import forkserver
from ignite_mgpu.processes.attempt_files import read_failures, read_statuses, read_value, with_error_files
from ignite_mgpu.processes.outcome import (
    Failure,
    Outcome,
    cut_short_before_stop,
    cut_short_while_saving,
    is_stop,
    last_words_failure,
    no_restart_reason,
    outcome,
    refused_start,
    server_died,
    timed_out,
    with_hang,
)
from ignite_mgpu.processes.relay import Relay
from ignite_mgpu.processes.worker import WorkerSpec, worker_main

# How long the workers' output is still relayed after they ended, for what their children write (relay.py).
RELAY_AFTER = 1.0
# After the first failure the other ranks get this long to exit by themselves (a peer that lost its connection
# does at once; the failing rank's failure file is written by then); longer only while one of them writes a checkpoint.
FAILURE_SETTLE = 1.0
STOPPED = signal_exit_code(signal.SIGTERM)  # a worker's code after a stop on SIGTERM (its checkpoint written)
NEVER = float("inf")
UNKNOWN = 255  # a worker's exit code when its fork server died before it could say it


@dataclass(frozen=True)
class Ended:
    """How an attempt ended: its outcome, why a restart cannot cure it (None: it can), the last iteration that every
    rank had completed, its ranks' failure files, when its first rank failed (or its ranks stopped for a change of
    size: ``resized``), and what the job's function returned on global rank 0 (None: nothing, or it failed)."""

    outcome: Outcome
    reason: str | None = None
    reached: int = 0
    failures: list[Failure] = field(default_factory=list)
    failed_at: float | None = None
    resized: bool = False
    value: Any = None


class Attempt:
    """One start of the workers (``spec``; ``index``: every start of the job counts, its folder is ``attempt<index>``):
    ``run`` starts, watches and stops them and says how they ended. ``stop`` (a stop request), ``stop_to_resize``
    (a change of size) and ``kill`` come from the supervisor, also from its signal handler. ``report_dir``: where a
    hang's report goes; ``stopping``: a stop signal that came before the attempt (it starts no worker)."""

    def __init__(self, spec: WorkerSpec, index: int, report_dir: str | None = None, stopping: int = 0) -> None:
        self.spec = spec
        self.index = index
        plan = spec.plan
        ranks = range(plan.first_rank, plan.first_rank + plan.nproc)
        gpus = dict(zip(ranks, plan.gpus or [], strict=False)) if plan.device == "cuda" else {}
        self.hangs = HangChecks(Path(spec.folder), ranks, plan.hang_seconds, report_dir, gpus, plan.backend == "nccl")
        self.procs: list[Any] = []
        self.first_failure: tuple[int, int] | None = None  # (local rank, exit code) of the first rank that failed
        self.died: list[int] = []  # local ranks killed by a signal before this attempt signalled any
        self.signalled = False  # whether the supervisor signalled the workers
        self.starting = False  # while the workers are being started
        self.stopped_while_starting = False  # then no worker has begun: all are killed once started
        self.stopping = stopping  # the signal that the supervisor received, which stops the attempt (0: none)
        self.resizing = False  # stopped for a change of size: a stop with its checkpoint is no failure
        self.cut_short = ""  # why a stop ended at once: a second signal, or the stop's grace ran out ("": it did not)
        self.failed_at: tuple[float, float] | None = None  # (time.monotonic(), time.time()) of the first failure
        self.failure_deadline = self.stop_deadline = NEVER

    @property
    def folder(self) -> Path:
        return Path(self.spec.folder)

    def run(self, look: Callable[[Attempt, float], None] | None = None) -> Ended:
        """Start every worker, watch them until all ended, and say how; ``look(attempt, now)`` runs at every look
        while they run (an elastic job's look at the line of waiting jobs)."""
        refused = None
        plan = self.spec.plan
        self.relay = Relay(range(plan.first_rank, plan.first_rank + plan.nproc), plan.rank_prefix)
        try:
            self.starting = True
            refused = self._start_all()
            self.starting = False
            # Stopped while the workers started (the first waits for the fork server's imports): none has begun,
            # and one started after the signal never got it.
            if self.stopped_while_starting:
                self.kill()
            if refused is None:
                self._watch(look)
        except KeyboardInterrupt:
            pass
        finally:
            self.starting = False
            self.kill()
            for p in self.procs:
                p.join(5)
            self.relay.close(RELAY_AFTER)
        if refused is not None:  # no restart: the machine would refuse it again
            return Ended(refused, refused.cause)
        return self._ended()

    def _start_all(self) -> Outcome | None:
        """Start the workers (no more once a stop came); an Outcome when the machine refused one."""
        nproc = self.spec.plan.nproc
        for local_rank in range(nproc):
            if self.stopping:
                break
            try:
                self.procs.append(self.start_worker(local_rank))
            # EAGAIN or ENOMEM from fork (ulimit -u, memory); EOFError: the fork server died of it before it answered.
            except (OSError, EOFError) as err:
                if isinstance(err, OSError) and err.errno not in (errno.EAGAIN, errno.ENOMEM):
                    raise
                return Outcome(USAGE, refused_start(local_rank, nproc, err))
        return None

    def start_worker(self, local_rank: int) -> Any:
        """Start one worker: forked by the fork server (started at the job's first attempt, kept for the others; the
        worker gets this process's environment, which the server lacks), or spawned or forked from here."""
        plan, spec = self.spec.plan, self.spec
        ctx: Any = mp.get_context(plan.start_method)  # every context has Process
        if plan.start_method == forkserver.METHOD:
            server = forkserver.start(forkserver.preload_for(spec.job), plan.preempt_signal)
            spec = dataclasses.replace(spec, parent=server, environ=dict(os.environ))
        else:
            spec = dataclasses.replace(spec, parent=os.getpid())
        spec = dataclasses.replace(spec, output=self.relay.ends(local_rank))
        p = ctx.Process(target=worker_main, args=(local_rank, spec), name=f"ignite-mgpu-rank{local_rank}")
        try:
            p.start()
        finally:
            self.relay.started(local_rank)
        return p

    def stop(self, received: int, sent: int) -> None:
        """Ask every worker to stop with the signal ``sent``, for the one that the supervisor ``received``: they
        get ``dist.stop_grace`` seconds before they are killed."""
        self.stopped_while_starting = self.starting
        self.stopping = received
        self._signal_all(sent)
        self.stop_deadline = time.monotonic() + self.spec.plan.stop_grace

    def stop_to_resize(self) -> None:
        """Stop every worker at its next check, for a change of size: each writes the stop's checkpoint."""
        self.resizing = True
        self._signal_all(signal.SIGTERM)

    def kill(self, cut_short: str = "") -> None:
        """SIGKILL every worker, and the process group of each (its data-loader workers); ``cut_short``: why a stop
        under way ends at once (for the last line)."""
        self.cut_short = self.cut_short or cut_short
        self._signal_all(signal.SIGKILL)

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

    @property
    def failed(self) -> bool:
        """Whether a worker failed (the others are being stopped)."""
        return self.failed_at is not None

    def _watch(self, look: Callable[[Attempt, float], None] | None) -> None:
        alive = {p.sentinel: p for p in self.procs}
        while alive:
            soonest = min(self.failure_deadline, self.stop_deadline) - time.monotonic()
            ended = [alive.pop(sentinel) for sentinel in wait(list(alive), timeout=min(0.5, max(0.05, soonest)))]
            for p in ended:
                p.join()
            # Seen together, a rank killed by a signal comes first: its peers' errors (a closed connection) follow it.
            for p in sorted(ended, key=lambda p: p.exitcode >= 0):
                self._ended_one(p)
            now = time.monotonic()
            if alive and look is not None:
                look(self, now)
            if alive and not self.failed and self.hangs.hung(now):
                self.kill()  # every rank's stacks are in the hang's report
            if alive and now > self.failure_deadline:
                self._after_failure(now, [p for p in self.procs if p.sentinel in alive])
            if now > self.stop_deadline:
                print(
                    f"ignite-mgpu: workers did not stop within {self.spec.plan.stop_grace:.0f} s; killing them.",
                    file=sys.stderr,
                )
                self.hangs.after_stop(self.spec.plan.stop_grace)
                self.kill(cut_short=f"they did not stop within dist.stop_grace={self.spec.plan.stop_grace:g} s")
                self.stop_deadline = NEVER

    def _ended_one(self, p: Any) -> None:
        """A worker ended: note the first failure, and a death by a signal that nobody here sent."""
        if self.resizing and p.exitcode == STOPPED:
            return  # stopped for a change of size, its checkpoint written
        if p.exitcode < 0 and not self.signalled:
            self.died.append(self.procs.index(p))
        if p.exitcode != 0 and self.first_failure is None:
            self.first_failure = (self.procs.index(p), p.exitcode)
        if p.exitcode != 0 and not self.stopping and self.failed_at is None:
            # One rank failed: the others cannot finish. With gloo their next collective fails at once ("Connection
            # closed by peer") and they exit by themselves; NCCL may hang. They get a short settle time, and longer
            # only while one writes a checkpoint (it is of a good iteration).
            self.failed_at = time.monotonic(), time.time()
            self.failure_deadline = self.failed_at[0] + FAILURE_SETTLE

    def _after_failure(self, now: float, living: list[Any]) -> None:
        """The settle time after the first failure is over: kill the living ranks unless one writes a checkpoint
        (then up to ``dist.stop_grace`` after the failure); a collective that timed out leaves a hang's report."""
        assert self.failed_at is not None
        ranks = [self.spec.plan.first_rank + self.procs.index(p) for p in living]
        saving = any(status.saving for status in read_statuses(self.folder, ranks))  # a dead rank's flag is stale
        if saving and now <= self.failed_at[0] + self.spec.plan.stop_grace:
            return
        aborted = self.first_failure is not None and self.first_failure[1] == -signal.SIGABRT
        if aborted or any(timed_out(f) for f in read_failures(self.folder)):  # NCCL's watchdog, or a timeout
            self.hangs.after_timeout()
        self.kill()
        self.failure_deadline = NEVER

    def _with_last_words(self, failures: list[Failure], exit_codes: list[int | None]) -> list[Failure]:
        """A rank killed by a signal without a failure file of its own (an abort in C++: NCCL's watchdog) is known
        by the last lines it wrote to stderr, where they name an error (relay.py kept them)."""
        recorded = {f["rank"] for f in failures}
        for local_rank, code in enumerate(exit_codes):
            rank = self.spec.plan.first_rank + local_rank
            if code is not None and code < 0 and rank not in recorded:
                said = last_words_failure(rank, *self.relay.last_words(local_rank), code)
                failures += [said] if said is not None else []
        return failures

    def _ended(self) -> Ended:
        """How the attempt ended, from the workers' exit codes and the files they left."""
        plan, folder = self.spec.plan, self.folder
        exit_codes = [p.exitcode for p in self.procs]
        reached = min((status.iteration for status in read_statuses(folder)), default=0)
        if self.resizing and exit_codes and set(exit_codes) == {STOPPED} and not self.stopping:
            return Ended(Outcome(STOPPED), None, reached, failed_at=time.time(), resized=True)
        failed_ranks = [plan.first_rank + i for i, code in enumerate(exit_codes) if code]
        failures = self._with_last_words(with_error_files(read_failures(folder), folder, failed_ranks), exit_codes)
        args = (failures, exit_codes, self.first_failure, self.stopping)
        result = outcome(*args, plan.first_rank, plan.timeout)
        # Every worker's code unknown (255): the fork server may have died, and them with it (its end is seen soon).
        if plan.start_method == forkserver.METHOD and not self.stopping and set(exit_codes) == {UNKNOWN}:
            result = server_died(result, forkserver.how_it_ended(wait=1.0))
        if self.cut_short:  # killed before every rank stopped by itself: what the stop's checkpoint became
            saving = any(s.saving for s in read_statuses(folder))
            result = cut_short_while_saving(result, saving)
            if not saving and plan.join_group and not any(is_stop(f["code"]) for f in failures):
                result = cut_short_before_stop(result, self.cut_short)
        if self.hangs.hang is not None:  # where every rank was
            result = with_hang(result, self.hangs.hang, bool(self.stopping))
        if self.died == [self.first_failure[0] if self.first_failure else -1] and result.rank is not None:
            result = dataclasses.replace(result, died=True)  # one rank's death: its first restart need not wait
        failed_at = self.failed_at[1] if self.failed_at is not None else time.time()
        value = read_value(folder) if result.code == SUCCESS else None
        return Ended(result, no_restart_reason(*args), reached, failures, failed_at, value=value)
