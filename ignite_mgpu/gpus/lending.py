"""Lending: what an elastic job (``--gpus auto:MIN-MAX``) does about the jobs waiting in line while it runs. It gives
a waiter the GPUs it holds above MIN when the free ones are too few for that waiter, in the line's order, and
takes free GPUs again (up to MAX) when nobody waits. ``change_for`` is pure; ``look`` reads the claims folder and the
GPU snapshot for it. The supervisor (``processes/elastic.py``) acts on the change. Torch-free.

The rules: never below MIN; never a GPU that another job claims; a waiter is lent to only when the GPUs lent,
with the free ones, let it start (else lending would only slow this job down); GPUs that another elastic job is
already lending count as free; a waiter that takes any GPUs (``auto``) and cannot be served holds every later
waiter behind it, as the line itself does (``acquire.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ignite_mgpu.gpus import claims, holders, inventory, links, waiting
from ignite_mgpu.gpus.acquire import busy
from ignite_mgpu.gpus.holders import Holder
from ignite_mgpu.gpus.waiting import Waiter


@dataclass(frozen=True)
class Change:
    """What the job does now: ``lend`` its GPUs (claim names) to the waiters ``to``, or ``take`` free ones."""

    lend: tuple[str, ...] = ()
    take: tuple[str, ...] = ()
    to: tuple[Holder, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.lend or self.take)


@dataclass(frozen=True)
class Line:
    """What the job sees at one look: the GPUs free now (no claim, no process, memory free; claim names in id
    order), those another elastic job is lending (free soon), and the waiters in line order."""

    free: tuple[str, ...]
    coming: tuple[str, ...]
    waiters: tuple[Waiter, ...]
    claimed: frozenset[str] = frozenset()  # every GPU some job claims (this one's too)
    # Claim name -> claim name -> their link as nvidia-smi topo -m prints it ("NV12", "SYS"); empty: unknown
    links: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


def change_for(held: list[str], low: int, high: int, line: Line, avoid: frozenset[str] = frozenset()) -> Change:
    """The change for a job holding ``held`` (claim names in CUDA order) on ``auto:low-high``. Lent first: the GPUs
    a waiter names, else those whose going leaves the job's GPUs best linked, its last ones where the links are
    unknown or equal (rank 0 keeps its GPU). ``avoid``: free GPUs never to take (left out after a failure); a waiter
    may have them. Taken: the free GPUs best linked to those held (``links.best_set``, as ``--gpus auto``
    chooses), in id order where the links are unknown or equal."""

    def link(a: str, b: str) -> str | None:
        return line.links.get(a, {}).get(b)

    pool = [*line.coming, *line.free]  # what a waiter can have without this job
    spare = len(held) - low
    lend: list[str] = []
    reserved: set[str] = set()  # this job's GPUs that an earlier waiter named: no later waiter gets them
    to: list[Holder] = []
    for w in line.waiters:
        if w.wants is not None:
            ours = [n for n in w.wants if n in held and n not in lend]
            if ours and len(ours) <= spare and all(n in pool or n in held for n in w.wants):
                lend += ours
                spare -= len(ours)
                to.append(w.who)
            reserved.update(n for n in w.wants if n in held)
            pool = [n for n in pool if n not in w.wants]
            continue
        short = w.count - len(pool)
        if short <= 0:  # the free GPUs serve it: it starts at its next look
            pool = pool[w.count :]
            continue
        candidates = [n for n in reversed(held) if n not in lend and n not in reserved]
        if short > min(spare, len(candidates)):
            break
        lend += _to_lend(held, lend, candidates, short, link)
        spare -= short
        pool = []
        to.append(w.who)
    takable = [n for n in line.free if n not in avoid]
    wanted = max(0, high - len(held))
    take = () if line.waiters else tuple(links.best_set(held, takable, wanted, link))
    return Change(tuple(lend), tuple(take), tuple(to))


def _to_lend(held: list[str], lend: list[str], candidates: list[str], short: int, link: links.LinkOf[str]) -> list[str]:
    """The ``short`` of ``candidates`` (the job's last GPUs first) to lend: the job keeps the best-linked set of the
    others with rank 0's GPU and those it keeps anyway; where that cannot be, or links are equal, the last ones."""
    choosable = [n for n in held if n in candidates and n != held[0]]
    if short >= len(choosable):
        return candidates[:short]
    kept = [n for n in held if n == held[0] or (n not in lend and n not in candidates)]
    keep = links.best_set(kept, choosable, len(choosable) - short, link)
    return [n for n in candidates if n not in keep and n != held[0]][:short]


def look(
    dir_fd: int, snapshot: list[inventory.GpuInfo], min_free_memory: float, waiters: list[Waiter] | None = None
) -> Line:
    """The claims folder and the snapshot as ``change_for`` needs them (``waiters``: the line, when already read)."""
    names = {g.index: claims.claim_name(g.uuid, g.pci_bus_id) for g in snapshot}
    held = holders.holders(dir_fd, names.values())
    unusable = busy(snapshot, min_free_memory)
    free = tuple(
        name for i, name in sorted(names.items()) if name not in held and i not in unusable and not _mig(snapshot, i)
    )
    coming = tuple(name for name, who in held.items() if name in who.lent)
    line = waiting.waiting(dir_fd) if waiters is None else waiters
    linked = {names[g.index]: {names[i]: g.path_to(i) or cell for i, cell in g.links if i in names} for g in snapshot}
    return Line(free, coming, tuple(line), frozenset(held), linked)


def _mig(snapshot: list[inventory.GpuInfo], index: int) -> bool:
    return any(g.mig for g in snapshot if g.index == index)
