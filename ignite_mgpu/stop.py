"""How a worker process is told to stop: the first stop signal it received, and how long a collective may wait
before the job gives up on a silent rank. The process layer sets both; the guard (guard.py) reads them.

Torch-free, a leaf like errors.py, so that the supervisor never imports the training code.
"""

from __future__ import annotations

_signal = 0
_collective_timeout: float | None = None


def request_stop(signum: int) -> None:
    """Ask every trainer in this process to stop at its next guard check (safe to call from a signal handler).
    The first request wins: a later signal does not rename the stop."""
    global _signal
    _signal = _signal or signum


def stop_requested() -> int:
    """The signal number of the first stop request, or 0."""
    return _signal


def set_collective_timeout(seconds: float | None) -> None:
    """Collectives after the first iteration wait at most ``seconds`` (None: the process group's own timeout)."""
    global _collective_timeout
    _collective_timeout = seconds


def collective_timeout() -> float | None:
    return _collective_timeout


def reset() -> None:
    """Forget every request (a new job in the same process, or a test)."""
    global _signal, _collective_timeout
    _signal, _collective_timeout = 0, None
