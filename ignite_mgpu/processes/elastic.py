"""An elastic job (``--gpus auto:MIN-MAX``) changing its GPUs between two attempts, the supervisor's side:

- after a failure, a failed GPU (``gpus/health.py``) is left out of the restart, never below MIN, and its claim is
  let go (``leave_out``); a job without a range restarts as before, told that a range would have continued;
- while it runs, every ``LOOK_EVERY`` seconds the ``Lender`` looks at the line of waiting jobs (``gpus/lending.py``
  decides): to lend, every rank stops at the next check (each writes the stop's checkpoint), the lent GPUs are let
  go once the workers are gone, and the job goes on with the GPUs kept; free GPUs, when nobody waits, are claimed
  first and then taken the same way (a ``Resize``).

Either way the next attempt runs on ``LaunchPlan.on_gpus`` and resumes the newest checkpoint on its number of
processes: the same run. What starts next is ``next_start.decide_next``'s. Torch-free."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ignite_mgpu.gpus import claims, health, inventory, lending, waiting
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.gpus.lending import Change
from ignite_mgpu.processes.outcome import Failure
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.text import format_ids, plural

# Seconds between two looks at the line (as often as a waiting job looks, acquire.POLL): a waiter's GPUs are lent
# within about this long plus one check and the stop's checkpoint.
LOOK_EVERY = 5.0
KERNEL_LOG_BEFORE = 300.0  # seconds of the kernel log read before the first failure (faults come before deaths)


@dataclass(frozen=True)
class LeftOut:
    """What the restart does about failed GPUs: ``plan`` on the GPUs left (None: the same plan), the claims to let
    go, the message for the log, and why the job cannot restart at all (None: it can)."""

    lost: list[health.Lost]
    message: str
    plan: LaunchPlan | None = None
    released: list[str] = field(default_factory=list)
    refusal: str | None = None


def leave_out(
    plan: LaunchPlan,
    failures: list[Failure],
    query: Callable[[], list[inventory.GpuInfo]] = inventory.query_gpus,
    kernel: Callable[[float], dict[str, str]] = health.kernel_faults,
) -> LeftOut | None:
    """After a failure that a restart can cure: None when none of the job's GPUs failed (or it chose none), else
    the GPUs the restart runs on, or the message saying what a range would have done."""
    if not plan.gpus or plan.external:
        return None
    # The kernel's log of the minutes around the first failure (an older fault may be on a GPU since reset).
    since = min((f.get("time", time.time()) for f in failures), default=time.time()) - KERNEL_LOG_BEFORE
    lost = health.lost_gpus(
        plan.gpus, plan.gpu_names, failures, query(), plan.first_rank, plan.strategy != "dp", kernel(since)
    )
    if not lost:
        return None
    gone = [x.physical_id for x in lost]
    named = "; ".join(f"GPU {x.physical_id} ({x.reason})" for x in lost)
    left = [i for i in plan.gpus if i not in gone]
    elastic = plan.gpu_range
    if elastic is None:
        maybe = f"--gpus auto:{max(1, len(left))}-{len(plan.gpus)}" if left else "a range of GPUs"
        on = f"GPU {format_ids(left)}" if left else "other GPUs"
        message = (
            f"failed: {named}. The restart runs on the same GPUs; {maybe} would have continued on {on} without it."
        )
        return LeftOut(lost, message)
    if len(left) < elastic.low:
        refusal = (
            f"{named} failed, leaving {plural(len(left), 'GPU')}, below the range's MIN {elastic.low} "
            f"(--gpus auto:{elastic})"
        )
        return LeftOut(lost, f"{refusal}.", refusal=refusal)
    smaller = plan.on_gpus({i: name for i, name in plan.gpu_names.items() if i in left})
    message = (
        f"left out {named}; its claim is released, and the restart continues on GPU {format_ids(left)} "
        f"({plural(smaller.nproc, 'process')}, was {plan.nproc}; --gpus auto:{elastic})."
    )
    return LeftOut(lost, message, smaller, [plan.gpu_names[i] for i in gone if i in plan.gpu_names])


def lends(plan: LaunchPlan, held: GpuClaims, resumes: bool) -> bool:
    """Whether a job lends: on a range, holding its claims (``held``), started here as the default job (which writes
    a checkpoint when stopped and resumes it: ``resumes``), on one node."""
    return bool(
        plan.gpu_range and held.names and plan.join_group and not plan.external and plan.nnodes == 1 and resumes
    )


@dataclass(frozen=True)
class Resize:
    """A change of size under way: the new GPUs (physical id -> claim name), what was lent or taken, and to whom."""

    change: Change
    names: dict[int, str]
    was: int  # processes before


@dataclass
class Lender:
    """The looks of one job on a range at the line of waiting jobs, with the claims it holds (``held``, the job's:
    the lender claims, adopts and lets go through them); ``lent`` are the GPUs it lent that a waiter still holds."""

    held: GpuClaims
    range: str  # MIN-MAX
    next_look: float = field(default_factory=lambda: time.monotonic() + LOOK_EVERY)
    seen_take: tuple[str, ...] = ()  # free GPUs seen at the last look: taken when seen twice
    lent: list[str] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # GPUs left out after a failure: never taken again

    def due(self, now: float) -> bool:
        """Whether the next look is due (every LOOK_EVERY seconds)."""
        return now >= self.next_look

    def look(self, plan: LaunchPlan, now: float) -> Resize | None:
        """The change to make now, its new GPUs claimed already; None: none. Looks again in LOOK_EVERY seconds."""
        if plan.gpu_range is None:
            return None
        self.next_look = now + LOOK_EVERY
        dir_fd = claims.open_dir(claims.claims_dir(), create=False)
        if dir_fd is None:
            return None
        try:
            held = [plan.gpu_names[i] for i in plan.gpus or [] if i in plan.gpu_names]
            waiters = waiting.waiting(dir_fd)
            if len(held) >= plan.gpu_range.high and not self.lent and not waiters:
                return None  # nothing to lend to, nothing to take: no nvidia-smi query
            snapshot = inventory.query_gpus()
            line = lending.look(dir_fd, snapshot, plan.min_free_memory, waiters)
            given_back = [n for n in self.lent if n not in line.claimed or n in held]
            # A GPU left out as failed is never taken again, even when it shows up idle.
            change = lending.change_for(held, plan.gpu_range.low, plan.gpu_range.high, line, frozenset(self.failed))
            # Free GPUs are taken when seen free at two looks in a row, not at a moment's gap between two jobs.
            take, self.seen_take = (change.take, ()) if change.take == self.seen_take else ((), change.take)
            change = Change(change.lend, take, change.to)
            if given_back:
                self.lent = [n for n in self.lent if n not in given_back]
                self._write()
            return self._begin(plan, dir_fd, snapshot, change) if change else None
        finally:
            os.close(dir_fd)

    def _begin(self, plan: LaunchPlan, dir_fd: int, snapshot: list[inventory.GpuInfo], change: Change) -> Resize | None:
        """The GPUs to take claimed (None: another job claimed one first), the lent ones written down."""
        names = {i: n for i, n in plan.gpu_names.items() if n not in change.lend}
        if change.take:
            taken = claims.claim(dir_fd, change.take, self.range)
            if taken is None:
                return None
            self.held.adopt(taken)
            found = {g.index: claims.claim_name(g.uuid, g.pci_bus_id) for g in snapshot}
            names.update({i: n for i, n in found.items() if n in change.take})
        self.lent += [n for n in change.lend if n not in self.lent]
        self._write()
        return Resize(change, names, plan.nproc)

    def _write(self) -> None:
        """The holder files say what the job has lent (``ignite-mgpu devices``; other lenders count it free soon)."""
        self.held.rewrite(claims.holder_record(self.range, self.lent, self.held.since))

    def cancel(self, resize: Resize) -> None:
        """The change did not happen (the job ended or failed meanwhile): what was taken goes back, nothing is lent."""
        self.held.release(resize.change.take)
        self.lent = [n for n in self.lent if n not in resize.change.lend]
        self._write()

    def message(self, resize: Resize, plan: LaunchPlan, where: str) -> str:
        """The change's message in the log, said when the job goes on (``where``: what it resumes from)."""
        change, ids = resize.change, sorted(resize.names)
        by_name = {n: i for i, n in {**plan.gpu_names, **resize.names}.items()}
        named = format_ids(sorted(by_name[n] for n in (change.lend or change.take) if n in by_name))
        if change.lend:
            whom = "; ".join(who.describe() for who in change.to)
            what = f"lent GPU {named} to {whom}, waiting in line"
        else:
            what = f"took GPU {named}, free and waited for by nobody"
        nproc = 1 if plan.strategy == "dp" else len(ids)
        return (
            f"{what}: the job goes on with {plural(nproc, 'process')} on GPU {format_ids(ids)} (was "
            f"{resize.was}; --gpus auto:{self.range}), {where}."
        )
