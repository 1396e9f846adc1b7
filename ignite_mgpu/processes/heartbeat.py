"""The hang watch: the supervisor reads each worker's status file (``env/stop.py``: the last completed iteration,
written after every iteration by the guard, and the beats of an evaluation iteration, a save, the trainer's start)
and judges the job hung when no rank has made progress for far longer than the slowest work seen so far.

The rule: hung when no rank's progress moved for ``max(dist.hang_seconds, FACTOR x the slowest interval between
two progress notes of any rank)``. The first interval, from the trainer's start to the first completed iteration
(the data loader's start, a compilation: minutes for a large compiled model), counts as pace but is not judged: the
job is judged once a rank completed an iteration. While any rank writes a checkpoint nobody is judged, and a save's
length does not count as pace. A job whose workers never note progress (a script under ``ignite-mgpu run`` that
uses no ignite-mgpu trainer) is never judged; ``dist.timeout`` still bounds every collective.

``HangWatch`` is pure over what it is shown (statuses and times); ``HangChecks`` is the supervisor's side: the
watch over one attempt's status files, and the hang's report (``hang_report.collect``) taken before the ranks are
killed, whether the watch found the hang, a collective timed out or the ranks did not answer a stop. Torch-free.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ignite_mgpu.env import stop
from ignite_mgpu.processes import hang_report
from ignite_mgpu.processes.outcome import Failure, Outcome, timed_out

if TYPE_CHECKING:
    from ignite_mgpu.processes.plan import LaunchPlan

FACTOR = 10.0  # how many times its slowest interval a job may stay silent


@dataclass
class _Pace:
    """One rank's progress as the watch saw it."""

    seen: tuple[int, int] = (0, 0)  # (iteration, beats) at the last change
    changed_at: float = 0.0
    slowest: float = 0.0  # the longest interval between two changes, saves left out
    armed: bool = False  # the trainer has started: intervals are measured
    was_saving: bool = False


@dataclass
class Silence:
    """The job is judged hung: silent for ``seconds``, against a ``window`` of that many seconds."""

    seconds: float
    window: float
    slowest: float  # the slowest interval seen, of which the window is FACTOR times (or the floor)
    iterations: dict[int, int]  # each rank's last completed iteration


class HangWatch:
    """One attempt's watch over its ranks' status files. ``floor``: ``dist.hang_seconds`` (0: off)."""

    def __init__(self, floor: float, factor: float = FACTOR) -> None:
        self.floor, self.factor = floor, factor
        self.paces: dict[int, _Pace] = {}

    def observe(self, statuses: dict[int, tuple[int, bool, int] | None], now: float) -> Silence | None:
        """Take every rank's status (``stop.read_progress``; None: none yet) at time ``now`` (monotonic seconds);
        a Silence when the job is judged hung."""
        if self.floor <= 0:
            return None
        saving = False
        for rank, status in statuses.items():
            if status is None:
                continue
            iteration, saving_now, beats = status
            pace = self.paces.setdefault(rank, _Pace(changed_at=now))
            if (iteration, beats) != pace.seen:
                if pace.armed and not pace.was_saving:
                    pace.slowest = max(pace.slowest, now - pace.changed_at)
                pace.seen, pace.changed_at, pace.armed = (iteration, beats), now, True
            pace.was_saving = saving_now
            saving = saving or saving_now
        armed = [p for p in self.paces.values() if p.armed]
        if saving:  # a rank writes a checkpoint; the others wait for it in their next collective
            for pace in armed:
                pace.changed_at = now
            return None
        if not any(p.seen[0] > 0 for p in armed):  # before the first iteration: measured, not judged
            return None
        slowest = max(p.slowest for p in armed)
        window = max(self.floor, self.factor * slowest)
        silent = now - max(p.changed_at for p in armed)
        if silent <= window:
            return None
        return Silence(silent, window, slowest, {rank: p.seen[0] for rank, p in self.paces.items()})


def hang_cause(silence: Silence) -> str:
    # The supervisor reads the progress twice a second: a shorter interval is not measured.
    slowest = f"{silence.slowest:.1f} s" if silence.slowest >= 1 else "under 1 s"
    return (
        f"the job hung: no rank made progress for {silence.seconds:.0f} s, longer than the hang watch's window of "
        f"{silence.window:.0f} s (max(dist.hang_seconds, {FACTOR:g} x the slowest interval so far, {slowest})); "
        "every rank was stopped."
    )


class HangChecks:
    """One attempt's hangs, for the supervisor: ``hung`` (the watch, at every look), ``after_failure`` and
    ``after_stop`` (before the living ranks are killed), then ``outcome``: where every rank was, in the report."""

    def __init__(self, plan: LaunchPlan, folder: Path) -> None:
        self.plan, self.folder = plan, folder
        self.watch = HangWatch(plan.hang_seconds)
        self.hang: hang_report.Hang | None = None
        self.iterations: dict[int, int] = {}

    def hung(self, nprocs: int, now: float) -> bool:
        """Whether the watch finds the job hung now (its report is then taken: kill the ranks)."""
        if self.hang is not None:
            return False
        offset = self.plan.node_rank * self.plan.nproc
        statuses = {rank: stop.read_progress(self.folder / f"status{rank}") for rank in range(offset, offset + nprocs)}
        silence = self.watch.observe(statuses, now)
        if silence is None:
            return False
        self.iterations = silence.iterations
        self._collect(hang_cause(silence), watched=True)
        return True

    def after_failure(self, first_failure: tuple[int, int] | None, failures: list[Failure]) -> None:
        """A rank timed out in a collective (or NCCL's watchdog aborted it): the living ranks are stuck."""
        aborted = first_failure is not None and first_failure[1] == -signal.SIGABRT
        if aborted or any(timed_out(f) for f in failures):
            self._collect("a rank timed out in a collective; the other ranks did not exit")

    def after_stop(self) -> None:
        self._collect(f"the workers did not stop within {self.plan.stop_grace:.0f} s (dist.stop_grace)")

    def _collect(self, why: str, watched: bool = False) -> None:
        if self.hang is not None:
            return
        try:
            self.hang = hang_report.collect(self.folder, self.plan, why, self.iterations, why if watched else None)
        except OSError as err:  # the report is a help: the job still ends as it must
            print(f"ignite-mgpu: could not write the hang's report ({err}).", flush=True)

    def outcome(self, result: Outcome, stopped: bool) -> Outcome:
        """The attempt's outcome, with where every rank was when a report was taken."""
        return result if self.hang is None else hang_report.with_hang(result, self.hang, stopped)
