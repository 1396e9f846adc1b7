"""The GPUs a job gets on a shared machine: ``--gpus`` planned around the GPUs that other jobs claim, the claims
taken all at once (``claims.py``), and with ``--wait`` a wait in line until enough GPUs are free. Torch-free.

Free, for ``--wait``: no other job claims the GPU, no compute process runs on it, and at least
``dist.min_free_memory`` of its memory is free (a job of another container shows only as used memory).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.errors import ConfigError, WaitInterrupted, WaitTimedOut
from ignite_mgpu.gpus import claims, holders, inventory, waiting
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.gpus.ranges import gpu_range
from ignite_mgpu.gpus.selection import GpuPlan, GpusTaken, parse_gpus, plan_gpus, used_ids
from ignite_mgpu.text import format_ids, plural

# Seconds between two looks while waiting: a job starts within this long of its GPUs becoming free.
POLL = 5.0
STATUS_EVERY = 60.0  # seconds between two lines saying what a waiting job waits for
_RACES = 20  # another job claimed between our look and our lock: look again, at most this often


def acquire(cfg: DistConfig, environ: Mapping[str, str], claim: bool = True) -> tuple[GpuPlan, GpuClaims]:
    """Plan ``cfg.gpus`` (``plan_gpus``) around other jobs' claims and claim the chosen GPUs, all or none.

    Nothing is claimed with ``dist.share``, without GPUs, or when ``claim`` is False (torchrun / SLURM own the
    GPUs they give a job). With ``dist.wait`` the job waits in line until the GPUs are free, printing what it
    waits for once a minute.

    Raises:
        GpusTaken: without ``dist.wait``, a GPU asked for is claimed by another job (auto: too few are left).
        WaitTimedOut: ``dist.wait`` ran out.
        WaitInterrupted: Ctrl-C (SIGINT) or SIGTERM while waiting; the place in line is given up.
        ConfigError: whatever ``plan_gpus`` refuses; a claims folder that cannot be used.
    """
    snapshot = inventory.query_gpus()
    first = plan_gpus(cfg.gpus, snapshot, environ, cfg.nproc)
    if not claim or cfg.share or not used_ids(cfg.gpus, first, snapshot, environ):
        return first, GpuClaims()
    dir_fd = claims.open_dir(claims.claims_dir(environ), create=True)
    assert dir_fd is not None
    try:
        if cfg.wait is None:
            return _claim_now(cfg, snapshot, environ, dir_fd)
        return _wait_and_claim(cfg, first, snapshot, environ, dir_fd)
    finally:
        os.close(dir_fd)


def _names(snapshot: list[inventory.GpuInfo], ids: list[int] | None) -> list[str]:
    """The claim names of the GPUs ``ids`` (None: every GPU)."""
    return [claims.claim_name(g.uuid, g.pci_bus_id) for g in snapshot if ids is None or g.index in ids]


def _range(cfg: DistConfig) -> str:
    """An elastic job's "MIN-MAX", written with its claims for `ignite-mgpu devices`."""
    elastic = gpu_range(cfg.gpus)
    return "" if elastic is None else str(elastic)


def _claimed(snapshot: list[inventory.GpuInfo], dir_fd: int) -> dict[int, str]:
    """Physical id -> "is claimed by alice (pid 4242, `...`, since ...)" for the GPUs that other jobs claim."""
    found = holders.holders(dir_fd, _names(snapshot, None))
    return {
        g.index: f"is claimed by {who.describe()}"
        for g in snapshot
        if (who := found.get(claims.claim_name(g.uuid, g.pci_bus_id))) is not None
    }


def busy(snapshot: list[inventory.GpuInfo], min_free: float) -> dict[int, str]:
    """Physical id -> why it is not free although unclaimed: its processes (and their users), too little memory."""
    found = {}
    for g in snapshot:
        why = []
        if g.n_processes > 0:
            whose = ", ".join(f"pid {p} of {holders.process_user(p) or '?'}" for p in g.pids[:4])
            processes = plural(g.n_processes, "process")
            why.append(f"runs {processes} ({whose})" if whose else f"runs {processes}")
        free, total = g.memory_total_mb - g.memory_used_mb, g.memory_total_mb
        if g.memory_total_mb > 0 and g.memory_used_mb >= 0 and free < min_free * total:
            why.append(f"has {free / 1024:.1f} of {total / 1024:.1f} GiB free, {min_free * total / 1024:.1f} needed")
        if why:
            found[g.index] = " and ".join(why)
    return found


def _claim_now(
    cfg: DistConfig, snapshot: list[inventory.GpuInfo], environ: Mapping[str, str], dir_fd: int
) -> tuple[GpuPlan, GpuClaims]:
    """No waiting: plan around the claims and claim; a job that claimed in between makes us look again."""
    for _ in range(_RACES):
        plan = plan_gpus(cfg.gpus, snapshot, environ, cfg.nproc, _claimed(snapshot, dir_fd))
        held = claims.claim(dir_fd, _names(snapshot, used_ids(cfg.gpus, plan, snapshot, environ)), _range(cfg))
        if held is not None:
            return plan, held
    raise ConfigError(
        f"--gpus {cfg.gpus}: other jobs kept claiming the GPUs this job chose, {_RACES} times in a row. Start it "
        "again, or wait in line with --wait [SECONDS]."
    )


def _wait_and_claim(
    cfg: DistConfig, first: GpuPlan, snapshot: list[inventory.GpuInfo], environ: Mapping[str, str], dir_fd: int
) -> tuple[GpuPlan, GpuClaims]:
    """Wait in line (a ticket) until the GPUs are free and the earlier waiters have theirs, then claim them."""
    auto = cfg.gpus is not None and parse_gpus(cfg.gpus)[0] == "auto"
    wanted = used_ids(cfg.gpus, first, snapshot, environ)
    elastic = gpu_range(cfg.gpus)
    # How many it needs, for an elastic job that could lend them (gpus/lending.py): a range's MIN.
    count = elastic.low if elastic is not None else max(1, len(wanted))
    ticket = waiting.Ticket(dir_fd, None if auto else _names(snapshot, wanted), count)
    start = time.monotonic()
    deadline, next_status, waited = start + (cfg.wait or 0.0), start, False
    what = f"--gpus {cfg.gpus}" if cfg.gpus is not None else "the GPUs this job sees (no --gpus)"
    # A range waits for its MIN; it takes up to MAX of the GPUs free then.
    free_gpus = (
        plural(len(wanted), "free GPU")
        if elastic is None
        else f"{plural(elastic.low, 'free GPU')} (up to {elastic.high})"
    )
    held: GpuClaims | None = None
    try:
        with _sigterm_raises():
            while True:
                plan, unavailable, ahead = _look(cfg, snapshot, environ, dir_fd, ticket)
                ids = [] if plan is None else used_ids(cfg.gpus, plan, snapshot, environ)
                held = None if plan is None else claims.claim(dir_fd, _names(snapshot, ids), _range(cfg))
                if plan is not None and held is not None:  # None: another job claimed them a moment ago
                    if waited:
                        _say(f"waited {_duration(time.monotonic() - start)}; claimed GPU {format_ids(ids)}.")
                    return plan, held
                now = time.monotonic()
                reasons = _reasons(unavailable, None if auto else wanted)
                if ahead:
                    reasons += f"; in line before it: {', '.join(who.describe() for who in ahead)}"
                if now >= deadline:
                    raise WaitTimedOut(
                        f"--wait {cfg.wait:g}: {what} did not find {free_gpus} within {_duration(cfg.wait or 0)}: "
                        f"{reasons}. Nothing was started. Wait longer (--wait alone waits without a limit), ask for "
                        "other GPUs, or run beside the other jobs on purpose with --share."
                    )
                if now >= next_status:
                    left = "no time limit" if deadline == float("inf") else f"{_duration(deadline - now)} left"
                    _say(f"waiting for {free_gpus} ({what}; {left}): {reasons}.")
                    next_status = now + STATUS_EVERY
                time.sleep(max(0.0, min(POLL, deadline - now, next_status - now)))
                snapshot, waited = inventory.query_gpus(), True
    except (KeyboardInterrupt, _Terminated) as stopped:
        if held is not None:  # claimed a moment before the signal: let them go, as the message says
            held.close()
        terminated = isinstance(stopped, _Terminated)
        raise WaitInterrupted(
            f"{'SIGTERM' if terminated else 'Ctrl-C'} after {_duration(time.monotonic() - start)} of waiting for "
            f"{free_gpus} ({what}): nothing was started, no GPU is claimed, and this job's place in line is given up.",
            signal.SIGTERM if terminated else signal.SIGINT,
        ) from None
    finally:
        ticket.close()


class _Terminated(Exception):
    """SIGTERM while waiting in line."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``_Terminated`` while the job waits in line, as Ctrl-C raises KeyboardInterrupt: its default
    action would end the command without a word. Only in the main thread, where a handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _look(
    cfg: DistConfig,
    snapshot: list[inventory.GpuInfo],
    environ: Mapping[str, str],
    dir_fd: int,
    ticket: waiting.Ticket,
) -> tuple[GpuPlan | None, dict[int, str], list[holders.Holder]]:
    """One look while waiting: the plan if its GPUs are free now and no earlier waiter comes first (else None),
    why each GPU that is not free is not, and the earlier waiters."""
    unavailable = {**busy(snapshot, cfg.min_free_memory), **_claimed(snapshot, dir_fd)}
    ahead = ticket.ahead()
    who = [w.who for w in ahead]
    # An earlier waiter's GPUs are its own, every GPU when it takes any (auto)
    for w in ahead:
        for g in snapshot:
            if w.wants is None or claims.claim_name(g.uuid, g.pci_bus_id) in w.wants:
                unavailable.setdefault(g.index, "is waited for by an earlier job")
    if any(w.wants is None for w in ahead):
        return None, unavailable, who
    try:
        return plan_gpus(cfg.gpus, snapshot, environ, cfg.nproc, unavailable), unavailable, who
    except GpusTaken:
        return None, unavailable, who


def _reasons(unavailable: dict[int, str], ids: list[int] | None) -> str:
    shown = {i: why for i, why in sorted(unavailable.items()) if ids is None or i in ids}
    return "; ".join(f"GPU {i} {why}" for i, why in shown.items()) or "the GPUs are free, another job just took them"


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}".rstrip("0").rstrip(".") + " s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min" + (f" {whole % 60} s" if whole % 60 else "")
    return f"{whole // 3600} h" + (f" {whole % 3600 // 60} min" if whole % 3600 // 60 else "")


def _say(line: str) -> None:
    print(f"ignite-mgpu: {line}", file=sys.stderr, flush=True)
