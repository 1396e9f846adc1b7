"""``--gpus auto``'s choice among the GPUs a job may take (``auto``, ``auto:N``, ``auto:MIN-MAX``): the idlest first (no
processes, then unknown, then busy); among equally idle ones the best-linked set (``links.py``: NVLink, one PCIe
switch, ... across CPU sockets, a pair without P2P half a step below its kind); then the most free memory, the least
load, the lowest id. Also the lines that say what it chose, where the links decided why, and which chosen GPU runs on
a narrowed PCIe link. Pure and torch-free."""

from __future__ import annotations

from ignite_mgpu.gpus import links
from ignite_mgpu.gpus.inventory import GpuInfo
from ignite_mgpu.text import format_ids


def describe(g: GpuInfo) -> str:
    """A GPU as the choice names it: "GPU 2 (no processes, 80.0 GiB free, 0% busy)"."""
    n = g.n_processes
    procs = {-1: "processes unknown", 0: "no processes", 1: "1 process"}.get(n, f"{n} processes")
    util = f", {g.utilization}% busy" if g.utilization >= 0 else ""
    return f"GPU {g.index} ({procs}, {(g.memory_total_mb - g.memory_used_mb) / 1024:.1f} GiB free{util})"


def _idleness(g: GpuInfo) -> int:
    """0 idle, 1 unknown, 2 running other work."""
    return 0 if g.n_processes == 0 else 1 if g.n_processes < 0 else 2


def rank(g: GpuInfo) -> tuple[int, int, int, int]:
    """The order without links: idle first (unknown next, busy last), then most free memory, least busy, lowest id."""
    return (_idleness(g), g.memory_used_mb - g.memory_total_mb, g.utilization if g.utilization >= 0 else 101, g.index)


def choose(spec: str, left: list[GpuInfo], count: int, every: list[GpuInfo]) -> tuple[list[int], list[str]]:
    """The ``count`` GPUs of ``left`` that ``auto`` takes (physical ids, sorted) and the lines saying so.

    Never a busier GPU for a better link: the GPUs as idle as the last one ``rank`` would take are the ones the
    links choose among, with the idler ones taken anyway. Where links are unknown or equal, ``rank``'s order stands.

    Args:
        spec: the ``--gpus`` value, for the lines; every: the whole snapshot, to say when a better-linked set was
            not free.
    """
    ranked = sorted(left, key=rank)
    plain = ranked[:count]
    boundary = _idleness(plain[-1]) if plain else 0
    sure = [g.index for g in plain if _idleness(g) < boundary]
    pool = [g.index for g in ranked if _idleness(g) == boundary]
    by_id = {g.index: g for g in every}

    def link(a: int, b: int) -> str | None:
        return by_id[a].path_to(b)

    ids = [*sure, *links.best_set(sure, pool, count - len(sure), link)]
    chosen = [g for g in ranked if g.index in ids]
    skipped = [g for g in ranked if g.index not in ids]
    line = f"--gpus {spec} chose {', '.join(describe(g) for g in chosen)}"
    plain_ids = [g.index for g in plain]
    if sorted(ids) != sorted(plain_ids):
        line += f" by their links: {_named(ids, link)} rather than {_named(plain_ids, link)}"
    messages = [line + (f"; skipped {', '.join(describe(g) for g in skipped)}." if skipped else ".")]
    if worse := _better_not_free(ids, [g.index for g in every if not g.mig], link):
        messages.append(worse)
    if busy := [g for g in chosen if g.n_processes > 0]:
        messages.append(f"Not enough idle GPUs: GPU {format_ids([g.index for g in busy])} already runs other work.")
    messages += [_narrowed(g) for g in chosen if g.pcie is not None and g.pcie.narrowed]
    return sorted(ids), messages


def _narrowed(g: GpuInfo) -> str:
    """The warning for a GPU on fewer PCIe lanes than it has (chosen anyway: the choice never avoids it)."""
    assert g.pcie is not None
    return (
        f"GPU {g.index} runs on a narrowed PCIe link, {g.pcie.describe()} (a smaller slot or a riser): its copies to "
        "the host and to GPUs without NVLink are slower."
    )


def _named(ids: list[int], link: links.LinkOf[int]) -> str:
    """A set with its worst link: "GPU 2,3 (NVLink NV12)"."""
    pair = links.worst_pair(sorted(ids), link)
    return f"GPU {format_ids(ids)} ({links.words(link(*pair) if pair else None)})"


def _better_not_free(ids: list[int], whole: list[int], link: links.LinkOf[int]) -> str:
    """The line saying that the chosen GPUs are linked only across CPU sockets while a better-linked set of as many
    exists on the machine but is not free; "" otherwise (a choice across sockets is never silent)."""
    key = links.set_key(ids, link)
    if len(ids) < 2 or key[0] < links.score("SYS"):
        return ""
    better = links.best_set([], whole, len(ids), link)
    if links.set_key(better, link) >= key:
        return ""
    return (
        f"{_named(ids, link)} are linked only across CPU sockets or worse; {_named(better, link)} would be linked "
        "better, but not all of them are free."
    )
