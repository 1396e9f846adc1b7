"""An elastic job changing its size while it runs (``--gpus auto:MIN-MAX``): the supervisor's side of lending. Every
``LOOK_EVERY`` seconds it looks at the line of waiting jobs (``gpus/lending.py`` decides); to lend, it stops every
rank at the next check (each writes the stop's checkpoint), lets the lent GPUs go once the workers are gone, and
starts them again on the GPUs kept; free GPUs, when nobody waits, are claimed first and then taken the same way.
The restart resumes the stop's checkpoint on the new number of processes: the same run. ``with_gpus`` is the plan
on another set of GPUs, shared with leaving out a failed GPU (``elastic.py``). Torch-free."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from ignite_mgpu.cpus.binding import BindingPlan, plan_for_job
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import claims, inventory, lending, waiting
from ignite_mgpu.gpus.lending import Change
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.text import format_ids, plural

# Seconds between two looks at the line (as often as a waiting job looks, acquire.POLL): a waiter's GPUs are lent
# within about this long plus one check and the stop's checkpoint.
LOOK_EVERY = 5.0


def with_gpus(plan: LaunchPlan, names: dict[int, str]) -> LaunchPlan:
    """``plan`` on the GPUs ``names`` (physical id -> claim name): one process each (one in all for ``dp``), the
    group's backend when there are several, the CPU binding planned again for them."""
    ids = sorted(names)
    nproc = 1 if plan.strategy == "dp" else len(ids)
    env = {**plan.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}
    if plan.cpu_share:  # OMP_NUM_THREADS is the plan's: the CPUs shared by the new number of processes
        env["OMP_NUM_THREADS"] = str(max(1, plan.cpu_share // nproc))
    binding = plan.binding
    if binding.mode != "none":
        try:
            binding = plan_for_job(binding.mode, nproc, ids, plan.device == "cuda", plan.strategy, os.environ)
        except ConfigError:
            binding = BindingPlan()  # the new size cannot be bound as asked: unbound, as --cpu-binding none
    return dataclasses.replace(
        plan,
        gpus=ids,
        nproc=nproc,
        backend=(plan.backend or plan.group_backend) if nproc * plan.nnodes > 1 else None,
        env=env,
        gpu_names=dict(sorted(names.items())),
        binding=binding,
    )


def lends(plan: LaunchPlan, resumes: bool) -> bool:
    """Whether a job lends: on a range, holding its claims, started here as the default job (which writes a
    checkpoint when stopped and resumes it: ``resumes``), on one node."""
    return bool(
        plan.gpu_range and plan.claims.names and plan.join_group and not plan.external and plan.nnodes == 1 and resumes
    )


@dataclass
class Resizing:
    """A change under way: the new GPUs (physical id -> claim name), what was lent or taken, and to whom."""

    change: Change
    names: dict[int, str]
    was: int  # processes before


class Lender:
    """The looks of one job on a range; ``lent`` are the GPUs it lent that a waiter still holds."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.next_look = time.monotonic() + LOOK_EVERY
        self.seen_take: tuple[str, ...] = ()  # free GPUs seen at the last look: taken when seen twice
        self.lent: list[str] = []
        self.failed: set[str] = set()  # GPUs left out after a failure (elastic.py)
        assert plan.gpu_range is not None
        self.range = str(plan.gpu_range)

    def due(self, now: float) -> bool:
        """Whether the next look is due (every LOOK_EVERY seconds)."""
        return now >= self.next_look

    def look(self, plan: LaunchPlan, now: float) -> Resizing | None:
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
            change = lending.decide(held, plan.gpu_range.low, plan.gpu_range.high, line, frozenset(self.failed))
            # Free GPUs are taken when seen free at two looks in a row, not at a moment's gap between two jobs.
            take, self.seen_take = (change.take, ()) if change.take == self.seen_take else ((), change.take)
            change = Change(change.lend, take, change.to)
            if given_back:
                self.lent = [n for n in self.lent if n not in given_back]
                self._write(plan)
            return self._begin(plan, dir_fd, snapshot, change) if change else None
        finally:
            os.close(dir_fd)

    def _begin(
        self, plan: LaunchPlan, dir_fd: int, snapshot: list[inventory.GpuInfo], change: Change
    ) -> Resizing | None:
        """The GPUs to take claimed (None: another job claimed one first), the lent ones written down."""
        names = {i: n for i, n in plan.gpu_names.items() if n not in change.lend}
        if change.take:
            taken = claims.claim(dir_fd, change.take, self.range)
            if taken is None:
                return None
            plan.claims.adopt(taken)
            found = {g.index: claims.claim_name(g.uuid, g.pci_bus_id) for g in snapshot}
            names.update({i: n for i, n in found.items() if n in change.take})
        self.lent += [n for n in change.lend if n not in self.lent]
        self._write(plan)
        return Resizing(change, names, plan.nproc)

    def _write(self, plan: LaunchPlan) -> None:
        """The holder files say what the job has lent (``ignite-mgpu devices``; other lenders count it free soon)."""
        plan.claims.rewrite(claims.holder_record(self.range, self.lent, plan.claims.since))

    def cancel(self, plan: LaunchPlan, resizing: Resizing) -> None:
        """The change did not happen (the job ended or failed meanwhile): what was taken goes back, nothing is lent."""
        plan.claims.release(resizing.change.take)
        self.lent = [n for n in self.lent if n not in resizing.change.lend]
        self._write(plan)

    def line(self, resizing: Resizing, plan: LaunchPlan, where: str) -> str:
        """The change's one line in the log, said when the job goes on (``where``: what it resumes from)."""
        change, ids = resizing.change, sorted(resizing.names)
        by_name = {n: i for i, n in {**plan.gpu_names, **resizing.names}.items()}
        named = format_ids(sorted(by_name[n] for n in (change.lend or change.take) if n in by_name))
        if change.lend:
            whom = "; ".join(who.describe() for who in change.to)
            what = f"lent GPU {named} to {whom}, waiting in line"
        else:
            what = f"took GPU {named}, free and waited for by nobody"
        nproc = 1 if plan.strategy == "dp" else len(ids)
        return (
            f"{what}: the job goes on with {plural(nproc, 'process')} on GPU {format_ids(ids)} (was "
            f"{resizing.was}; --gpus auto:{self.range}), {where}."
        )
