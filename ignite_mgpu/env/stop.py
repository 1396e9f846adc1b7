"""How a worker process is told to stop, and what it tells its supervisor: the first stop signal it received, how
long a collective may wait before the job gives up on a silent rank (every process group of the job is made with
it), and its status file (``Status``: its last completed iteration, whether it is writing a checkpoint, its other
activity, the set-up's waypoints it passed), which the supervisor's hang watch reads. The process layer sets them up;
the guard, the evaluator and the checkpoint handlers write the status.

Torch-free, a leaf like errors.py, so that the supervisor never imports the training code.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

_signal = 0
_signal_at = 0.0  # time.monotonic() of the first stop request
# Seconds within which a repeat of the first stop signal is the same request, not a second one that stops at once:
# GNU timeout sends its signal to its child and then to the child's process group (the child gets it twice, within
# microseconds); a person who reads the first line and presses Ctrl-C again takes longer.
SAME_REQUEST_WITHIN = 1.0
_collective_timeout: float | None = None
_map: mmap.mmap | None = None  # the worker's status file, mapped
# _map as the four fields of a Status: [iteration, saving 0/1, activity, waypoints]
_status: memoryview | None = None
_STATUS = struct.Struct("qqqq")
# Saves in progress: the training thread's and a background write.
_saving, _saving_lock = 0, threading.Lock()


class Status(NamedTuple):
    """What a worker's status file says."""

    iteration: int  # the last completed training iteration
    saving: bool  # writing a checkpoint now
    activity: int  # a count of the other signs of progress: the trainer's start, evaluation iterations, saves
    # The set-up's waypoints passed, the same sequence on every rank (the model built, the trainer started, the
    # first batch in hand): before the first iteration, a rank behind the others keeps them waiting.
    waypoints: int = 0


def request_stop(signum: int) -> None:
    """Ask every trainer in this process to stop at its next guard check (safe to call from a signal handler).
    The first request wins: a later signal does not rename the stop."""
    global _signal, _signal_at
    if not _signal:
        _signal, _signal_at = signum, time.monotonic()


def same_request(first: int, first_at: float, signum: int, now: float) -> bool:
    """Whether ``signum`` received at ``now`` repeats the stop request ``first`` (received at ``first_at``, 0: none
    yet): the same signal within SAME_REQUEST_WITHIN seconds, as GNU timeout sends it twice."""
    return bool(first) and signum == first and now - first_at < SAME_REQUEST_WITHIN


def repeats_request(signum: int) -> bool:
    """Whether ``signum``, received now, repeats this process's first stop request (``same_request``)."""
    return same_request(_signal, _signal_at, signum, time.monotonic())


def stop_requested() -> int:
    """The signal number of the first stop request, or 0."""
    return _signal


def set_collective_timeout(seconds: float | None) -> None:
    """Every collective of every process group this worker makes waits at most ``seconds`` (``dist.timeout``; None:
    torch's default, 10 minutes for NCCL and 30 for gloo)."""
    global _collective_timeout
    _collective_timeout = seconds


def collective_timeout() -> float | None:
    return _collective_timeout


def group_timeout() -> timedelta | None:
    """The ``timeout=`` that every ``init_process_group`` and ``new_group`` of the package passes: a side group made
    without it keeps torch's default, whatever the job's group was given (``set_timeout`` changes one group)."""
    return None if _collective_timeout is None else timedelta(seconds=_collective_timeout)


def set_status_file(path: str | Path | None) -> None:
    """Where this worker tells its supervisor how far it got (None: nobody asks; every note is a no-op).

    The file is mapped into memory: noting an iteration is one store into a shared page, no system call, so it
    can be done after every iteration.
    """
    global _map, _status
    if _status is not None and _map is not None:
        _status.release()
        _map.close()
    _map = _status = None
    if path is None:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _STATUS.size)
            _map = mmap.mmap(fd, _STATUS.size)
        finally:
            os.close(fd)
    except OSError:
        return  # progress notes are a convenience; training goes on without them
    _status = memoryview(_map).cast("q")


def note_iteration(iteration: int) -> None:
    """This rank completed ``iteration`` (called after every iteration)."""
    if _status is not None:
        _status[0] = iteration


def note_waypoint() -> None:
    """This rank passed the next waypoint of the set-up, one that every rank passes in the same order, before a
    point where the ranks wait for each other (the model's wrapping, the first step). Before the first iteration the
    hang watch judges a rank behind the others (``hangs/watch.py``)."""
    if _status is not None:
        _status[3] += 1


def note_activity() -> None:
    """Progress that is not a training iteration: training starts, an evaluation iteration, a save begins or
    ends. The supervisor's hang watch (``hangs/watch.py``) counts it as a sign of life."""
    if _status is not None:
        _status[2] += 1


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """While a checkpoint is being written: a supervisor stopping the job after another rank's failure waits for
    it, so the checkpoint of a good iteration still lands. Nests, also across threads (a background write
    outlives the save that started it): the flag clears when the last one ends."""
    global _saving
    with _saving_lock:
        _saving += 1
        if _status is not None:
            _status[1] = 1
            _status[2] += 1
    try:
        yield
    finally:
        with _saving_lock:
            _saving -= 1
            if _status is not None and not _saving:
                _status[1] = 0
                _status[2] += 1


def read_status(path: str | Path) -> Status | None:
    """A worker's status file; None when there is none."""
    try:
        iteration, saving_now, activity, waypoints = _STATUS.unpack(Path(path).read_bytes())
    except (OSError, struct.error):
        return None
    return Status(iteration, bool(saving_now), activity, waypoints)


def reset() -> None:
    """Forget every request (a new job in the same process, or a test)."""
    global _signal, _collective_timeout
    set_status_file(None)
    _signal, _collective_timeout = 0, None
