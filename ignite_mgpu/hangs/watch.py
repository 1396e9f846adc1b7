"""The hang watch: the supervisor reads each worker's status file (``env/stop.py``: the last completed iteration,
written after every iteration by the guard, and the other activity: an evaluation iteration, a save, the trainer's
start) and judges the job hung when no rank has made progress for far longer than the slowest work seen so far.

The rule: hung when no rank's status moved for ``max(dist.hang_seconds, FACTOR x the slowest interval between
two changes of any rank's status)``. The first interval, from the trainer's start to the first completed iteration
(the data loader's start, a compilation: minutes for a large compiled model), counts as pace but is not judged by
that rule. Before the first iteration, one rule only: every rank passes the set-up's waypoints in the same order
(``stop.note_waypoint``: the model built, the trainer started, the first batch in hand), each before a point where
the ranks wait for each other; when some rank is behind another (which then waits for it in a collective) and no
rank moved for ``FIRST_STEP x dist.hang_seconds``, the job is hung. Set-up or a first step that is slow on every rank
alike (a compilation) is never judged here; ``dist.timeout`` bounds every collective from the group's creation.
While any rank writes a checkpoint nobody is judged, and a save's length does not count as pace. A job whose workers
never write a status (a script under ``ignite-mgpu run`` that uses no ignite-mgpu trainer) is never judged;
``dist.timeout`` still bounds every collective.

After the first iteration, once no rank moved for ``max(PROBE_AFTER, PROBE_FACTOR x the slowest interval)``, the
ranks' stacks are looked at once per quiet spell: ranks that all wait in collectives, not all in the same one, never
meet (their calls do not match), and the job is judged hung then.

``HangWatch`` is pure over what it is shown (statuses and times); ``HangChecks`` is one attempt's side: the watch
over the attempt's status files, and the hang's report (``hang_report.collect``) taken before the ranks are killed,
whether the watch found the hang, a collective timed out or the ranks did not answer a stop. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ignite_mgpu.env.stop import Status, read_status
from ignite_mgpu.hangs import hang_report, stacks

FACTOR = 10.0  # how many times its slowest interval a job may stay silent
# Before the first iteration, how many times dist.hang_seconds a rank may stay behind another's waypoint with no rank
# moving (120 s by default): the ranks pass them seconds apart, and the first to pass waits in a collective.
FIRST_STEP = 2.0
# After the first iteration, when no rank moved for max(PROBE_AFTER, PROBE_FACTOR x the slowest interval), the ranks'
# stacks are looked at once (until the next move): ranks that all wait in collectives, not all the same one, never
# meet, and the job is ended then, not a window later.
PROBE_AFTER = 5.0
PROBE_FACTOR = 3.0


@dataclass
class _Pace:
    """One rank's progress as the watch saw it."""

    seen: tuple[int, int] = (0, 0)  # (iteration, activity) at the last change
    changed_at: float = 0.0
    slowest: float = 0.0  # the longest interval between two changes, saves left out
    armed: bool = False  # the trainer has started: intervals are measured
    was_saving: bool = False
    waypoints: int = 0  # the set-up's waypoints passed (stop.note_waypoint)
    moved_at: float = 0.0  # the last change of anything: iteration, activity or waypoints


@dataclass
class Silence:
    """The job is judged hung: silent for ``seconds``, against a ``window`` of that many seconds."""

    seconds: float
    window: float
    slowest: float  # the slowest interval seen, of which the window is FACTOR times (or the floor)
    iterations: dict[int, int]  # each rank's last completed iteration
    behind: tuple[int, ...] = ()  # judged before the first iteration: the ranks behind the others' waypoint


class HangWatch:
    """One attempt's watch over its ranks' status files. ``floor``: ``dist.hang_seconds`` (0: off)."""

    def __init__(self, floor: float, factor: float = FACTOR) -> None:
        self.floor, self.factor = floor, factor
        self.paces: dict[int, _Pace] = {}

    def observe(self, statuses: Mapping[int, Status | tuple[int, bool, int] | None], now: float) -> Silence | None:
        """Take every rank's status (``stop.read_status``; None: none yet) at time ``now`` (monotonic seconds); a
        Silence when the job is judged hung."""
        if self.floor <= 0:
            return None
        saving = False
        for rank, status in statuses.items():
            if status is None:
                continue
            iteration, saving_now, activity, waypoints = Status(*status)  # a tuple of three: no waypoint
            pace = self.paces.setdefault(rank, _Pace(changed_at=now, moved_at=now))
            if (iteration, activity, waypoints) != (*pace.seen, pace.waypoints):
                pace.moved_at = now
            if (iteration, activity) != pace.seen:
                if pace.armed and not pace.was_saving:
                    pace.slowest = max(pace.slowest, now - pace.changed_at)
                pace.seen, pace.changed_at, pace.armed = (iteration, activity), now, True
            pace.was_saving, pace.waypoints = saving_now, waypoints
            saving = saving or saving_now
        armed = [p for p in self.paces.values() if p.armed]
        if saving:  # a rank writes a checkpoint; the others wait for it in their next collective
            for pace in armed:
                pace.changed_at = now
            for pace in self.paces.values():
                pace.moved_at = now
            return None
        if not any(p.seen[0] > 0 for p in armed):
            return self._first_step(now)
        slowest = max(p.slowest for p in armed)
        window = max(self.floor, self.factor * slowest)
        silent = now - max(p.changed_at for p in armed)
        if silent <= window:
            return None
        return Silence(silent, window, slowest, self.iterations())

    def quiet(self) -> tuple[float, float] | None:
        """After the first iteration, while no rank saves: (when a rank last moved, the slowest interval); None
        otherwise."""
        armed = [p for p in self.paces.values() if p.armed]
        if self.floor <= 0 or not any(p.seen[0] > 0 for p in armed) or any(p.was_saving for p in armed):
            return None
        return max(p.changed_at for p in armed), max(p.slowest for p in armed)

    def _first_step(self, now: float) -> Silence | None:
        """Before the first iteration: hung when a rank is behind another's waypoint and no rank moved for
        FIRST_STEP x the floor. Set-up or a first step slow on every rank alike (a compilation) is not judged."""
        ahead = max((p.waypoints for p in self.paces.values()), default=0)
        behind = tuple(rank for rank, pace in sorted(self.paces.items()) if pace.waypoints < ahead)
        if not behind:
            return None
        window = FIRST_STEP * self.floor
        silent = now - max(p.moved_at for p in self.paces.values())
        if silent <= window:
            return None
        slowest = max(p.slowest for p in self.paces.values())
        return Silence(silent, window, slowest, self.iterations(), behind)

    def iterations(self) -> dict[int, int]:
        return {rank: p.seen[0] for rank, p in self.paces.items()}


def hang_cause(silence: Silence) -> str:
    if silence.behind:
        ranks = ", ".join(map(str, silence.behind))
        return (
            f"the job hung before its first iteration: rank(s) {ranks} stayed behind the others, which waited for "
            f"them, and no rank moved for {silence.seconds:.0f} s (the window before the first iteration: "
            f"{FIRST_STEP:g} x dist.hang_seconds, {silence.window:.0f} s); every rank was stopped."
        )
    # The supervisor reads the progress twice a second: a shorter interval is not measured.
    slowest = f"{silence.slowest:.1f} s" if silence.slowest >= 1 else "under 1 s"
    return (
        f"the job hung: no rank made progress for {silence.seconds:.0f} s, longer than the hang watch's window of "
        f"{silence.window:.0f} s (max(dist.hang_seconds, {FACTOR:g} x the slowest interval so far, {slowest})); "
        "every rank was stopped."
    )


class HangChecks:
    """One attempt's hangs: ``hung`` (the watch, at every look), ``after_timeout`` and ``after_stop`` (before the
    living ranks are killed); ``hang`` is then where every rank was, with its report's file.

    ``folder``: the attempt's (status and stacks files); ``ranks``: the global ranks of this node's workers;
    ``report_dir``: where the report goes (the run folder); ``gpus``: each global rank's physical GPU, where known."""

    def __init__(
        self,
        folder: Path,
        ranks: range,
        hang_seconds: float,
        report_dir: str | None = None,
        gpus: Mapping[int, int] | None = None,
        nccl: bool = False,
    ) -> None:
        self.folder = folder
        self.ranks = ranks
        self.report_dir = Path(report_dir or ".")
        self.gpus = dict(gpus or {})
        self.nccl = nccl
        self.watch = HangWatch(hang_seconds)
        self.hang: hang_report.Hang | None = None
        self.iterations: dict[int, int] = {}
        self.probed: float | None = None  # the quiet spell whose stacks were looked at (its start)

    def hung(self, now: float) -> bool:
        """Whether the watch finds the job hung now (its report is then taken: kill the ranks)."""
        if self.hang is not None:
            return False
        statuses = {rank: read_status(self.folder / f"status{rank}") for rank in self.ranks}
        silence = self.watch.observe(statuses, now)
        if silence is None:
            return self._mismatched(now)
        self.iterations = silence.iterations
        self._collect(hang_cause(silence), watched=True, behind=silence.behind)
        return True

    def _mismatched(self, now: float) -> bool:
        """Once per quiet spell of ``PROBE_AFTER`` seconds or more: whether the ranks' stacks show them waiting in
        different collectives (their calls do not match: they never meet). The report is then taken."""
        quiet = self.watch.quiet()
        if quiet is None or now - quiet[0] < max(PROBE_AFTER, PROBE_FACTOR * quiet[1]) or self.probed == quiet[0]:
            return False
        self.probed = quiet[0]
        texts = stacks.dump(stacks.ranks_in(self.folder))
        called = hang_report.mismatch({rank: hang_report.where(text) for rank, text in texts.items()})
        if not called or len(texts) < len(self.ranks):
            return False
        self.iterations = self.watch.iterations()
        cause = (
            f"the ranks wait in different collectives after {now - quiet[0]:.0f} s without progress: their calls do "
            "not match, and they would wait until dist.timeout; every rank was stopped."
        )
        self._collect(cause, watched=True)
        return True

    def after_timeout(self) -> None:
        """A rank timed out in a collective (or NCCL's watchdog aborted it): the living ranks are stuck."""
        self._collect("a rank timed out in a collective; the other ranks did not exit")

    def after_stop(self, grace: float) -> None:
        """The ranks did not stop within ``grace`` seconds of being asked."""
        self._collect(f"the workers did not stop within {grace:.0f} s (dist.stop_grace)")

    def _collect(self, why: str, watched: bool = False, behind: tuple[int, ...] = ()) -> None:
        if self.hang is not None:
            return
        try:
            cause = why if watched else None
            self.hang = hang_report.collect(
                self.folder, self.report_dir, why, self.iterations, self.gpus, self.nccl, cause, behind
            )
        except OSError as err:  # the report is a help: the job still ends as it must
            print(f"ignite-mgpu: could not write the hang's report ({err}).", flush=True)
