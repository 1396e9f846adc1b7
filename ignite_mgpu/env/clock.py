"""When this job started and when its previous attempt failed: the anchors of the goodput accounting
(``train/goodput.py``). The launching process records them in the plan; each worker sets them here before the job
function runs. Torch-free, a leaf like ``stop.py``."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

_IMPORTED = time.time()
# The CPU time this process had used by then: the interpreter's start-up and the imports before this one.
_CPU_BEFORE = time.process_time()
_command_start: list[float] = []  # set by the CLI (use_interpreter_start)


# One value per process (a forked child keeps its parent's: its job's plan was made there)
@functools.cache
def process_start() -> float:
    """This process's start as a ``time.time()`` (Linux: from ``/proc/self/stat``, so the interpreter's own start-up
    counts; elsewhere the time this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22, starttime: clock ticks since boot.
            ticks = int(f.read().rpartition(")")[2].split()[19])
        # Starttime counts from boot, as this clock does.
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return min(_IMPORTED, time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


def interpreter_start() -> float:
    """When this Python interpreter began: this module's import less the CPU time the process had used by then
    (the interpreter's start-up and imports are CPU work), never before the process's start. Later than
    ``process_start()`` when the process ran another program first and then became Python by exec: ``sh -c
    'pip install ... && ignite-mgpu train'`` (a shell execs its last command), whose start would count the install."""
    return max(process_start(), _IMPORTED - _CPU_BEFORE)


def use_interpreter_start() -> None:
    """The command is this interpreter (``ignite-mgpu ...``): goodput's start is the interpreter's, not the process's
    (see ``interpreter_start``). Called by the CLI; Python code calling ``fit`` keeps its process's start (its
    script's own start-up, the time before the call, counts)."""
    _command_start[:] = [interpreter_start()]


def command_start() -> float:
    """Goodput's start of a job launched from here: the interpreter's for the CLI, else the process's."""
    return _command_start[0] if _command_start else process_start()


@dataclass(frozen=True)
class JobClock:
    """The anchors of one attempt of a job, as ``time.time()`` values."""

    # The command's start (command_start() of the launching process); under torchrun / SLURM, this process's.
    started: float
    # A restart: when the previous attempt's first rank failed, or (a change of size) when its ranks had stopped
    # (None: a first start)
    failed_at: float | None = None
    # A restart: the last iteration that every rank of the previous attempt had completed.
    reached: int = 0
    # A restart on another number of processes (a failed GPU left out, GPUs lent or taken back: an elastic job):
    # how many the previous attempt had.
    resized_from: int | None = None


def first_attempt() -> JobClock:
    """The anchors of a job's first attempt, launched from this process: the command's start."""
    return JobClock(command_start())


_current: JobClock | None = None


def set_clock(clock: JobClock | None) -> None:
    """This worker's anchors (None: forget them, e.g. between the jobs of a test)."""
    global _current
    _current = clock


def job_clock() -> JobClock:
    """The anchors set for this process; without any (the job function called directly), the command's start."""
    return _current if _current is not None else first_attempt()
