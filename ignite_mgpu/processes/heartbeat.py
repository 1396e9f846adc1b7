"""The hang watch: the supervisor reads each worker's status file (``env/stop.py``: the last completed iteration,
written after every iteration by the guard, and the beats of an evaluation iteration, a save, the trainer's start)
and judges the job hung when no rank has made progress for far longer than the slowest work seen so far.

The rule: hung when no rank's progress moved for ``max(dist.hang_seconds, FACTOR x the slowest interval between
two progress notes of any rank)``. The watch starts at the trainer's start, so the first interval holds the first
iteration (data loader start, compilation); while any rank writes a checkpoint nobody is judged, and a save's
length does not count as pace. A job whose workers never note progress (a script under ``ignite-mgpu run`` that
uses no ignite-mgpu trainer) is never judged; ``dist.timeout`` still bounds every collective.

Torch-free, pure over what it is shown: the supervisor passes the statuses and the time.
"""

from __future__ import annotations

from dataclasses import dataclass

FACTOR = 10.0  # how many times its slowest interval a job may stay silent


@dataclass
class _Pace:
    """One rank's progress as the watch saw it."""

    seen: tuple[int, int] = (0, 0)  # (iteration, beats) at the last change
    changed_at: float = 0.0
    slowest: float = 0.0  # the longest interval between two changes, saves left out
    armed: bool = False  # the trainer has started
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
        if not armed:
            return None
        slowest = max(p.slowest for p in armed)
        window = max(self.floor, self.factor * slowest)
        silent = now - max(p.changed_at for p in armed)
        if silent <= window:
            return None
        return Silence(silent, window, slowest, {rank: p.seen[0] for rank, p in self.paces.items()})
