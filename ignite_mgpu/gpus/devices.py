"""The ``ignite-mgpu devices`` table: every GPU of the snapshot, what runs on it and whose it is, the job that
claims it, its CUDA index under this environment's CUDA_VISIBLE_DEVICES, how the GPUs are linked (with P2P) and
each one's PCIe link. Torch-free."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import claims, holders, links
from ignite_mgpu.gpus.inventory import GpuInfo
from ignite_mgpu.gpus.selection import visible_ids
from ignite_mgpu.text import format_ids

_NO_GPU_TEXT = (
    "No NVIDIA GPU found (nvidia-smi not available or shows none). "
    "Training would use the CPU: backend gloo, 1 process by default (--nproc N to change)."
)


@dataclass(frozen=True)
class Occupancy:
    """Who has each GPU (``who_has``): the job that claims it and the users of its processes."""

    # Physical id -> the claim's holder.
    claims: dict[int, holders.Holder] = field(default_factory=dict)
    users: dict[int, str] = field(default_factory=dict)  # pid -> user ("?": not visible from here)
    note: str = ""  # why the claims could not be read


def who_has(gpus: list[GpuInfo], environ: Mapping[str, str]) -> Occupancy:
    """Read the claims folder (never creating it) and /proc for the snapshot's GPUs and processes."""
    users = {pid: holders.process_user(pid) or "?" for g in gpus for pid in g.pids}
    try:
        dir_fd = claims.open_dir(claims.claims_dir(environ), create=False)
    except ConfigError as err:
        return Occupancy({}, users, str(err))
    try:
        found = holders.holders(dir_fd, [claims.claim_name(g.uuid, g.pci_bus_id) for g in gpus])
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    by_id = {g.index: found[n] for g in gpus if (n := claims.claim_name(g.uuid, g.pci_bus_id)) in found}
    return Occupancy(by_id, users)


def elastic_jobs(held: Occupancy, gpus: list[GpuInfo]) -> list[tuple[holders.Holder, list[int], list[int]]]:
    """The jobs on a range of GPUs (``--gpus auto:MIN-MAX``) among the claims, each with the GPUs it holds and
    those it lent to jobs that waited in line (physical ids)."""
    found: dict[tuple[str, int | None], tuple[holders.Holder, list[int], list[int]]] = {}
    ids = {claims.claim_name(g.uuid, g.pci_bus_id): g.index for g in gpus}
    for index, who in sorted(held.claims.items()):
        if who.known and who.gpu_range:
            lent = sorted(ids[name] for name in who.lent if name in ids)
            found.setdefault((who.user, who.pid), (who, [], lent))[1].append(index)
    return list(found.values())


def cuda_index_map(gpus: list[GpuInfo], environ: Mapping[str, str]) -> dict[int, int | None]:
    """Map each physical id to its CUDA index under environ's CUDA_VISIBLE_DEVICES (None = hidden or unknown).

    The mapping assumes CUDA_DEVICE_ORDER=PCI_BUS_ID, which the launcher sets whenever ``--gpus`` is given.
    Without it CUDA numbers devices fastest-first, which agrees with nvidia-smi only when all GPUs are the
    same model. When CUDA_VISIBLE_DEVICES holds UUIDs or MIG names every value is None (cannot tell).
    """
    visible = visible_ids(gpus, environ) or []
    return {g.index: visible.index(g.index) if g.index in visible else None for g in gpus}


def _as_json(
    gpus: list[GpuInfo], cuda: dict[int, int | None], fallback: dict[str, object] | None, held: Occupancy
) -> str:
    """``ignite-mgpu devices --json``: each GPU with its CUDA index and claim, and the elastic jobs."""
    rows = [
        {
            **asdict(g),
            "links": {str(other): cell for other, cell in g.links},  # physical id -> as nvidia-smi topo -m prints it
            "p2p": {str(other): status for other, status in g.p2p},  # physical id -> as topo -p2p r prints it
            "pcie": None if g.pcie is None else {**asdict(g.pcie), "narrowed": g.pcie.narrowed},
            "cuda_index": cuda[g.index],
            "claim": held.claims[g.index].as_json() if g.index in held.claims else None,
            "process_users": {str(pid): held.users[pid] for pid in g.pids if pid in held.users},
        }
        for g in gpus
    ]
    note = {"claims_note": held.note} if held.note else {}  # the claims folder cannot be read
    elastic = [
        {"user": who.user, "pid": who.pid, "range": who.gpu_range, "holds": ids, "lent": lent}
        for who, ids, lent in elastic_jobs(held, gpus)
    ]
    ranges = {"elastic_jobs": elastic} if elastic else {}  # jobs on --gpus auto:MIN-MAX
    return json.dumps({"gpus": rows, "cpu_fallback": fallback, **ranges, **note}, indent=2)


def link_lines(gpus: list[GpuInfo]) -> list[str]:
    """Each GPU's NUMA node, PCIe link and links, grouped by kind, best first ("GPU 0 (NUMA 0, PCIe 4.0 x16): NV4 to
    1; SYS to 2,3"), the pairs without P2P ("no P2P to 2,3 (CNS)"), and what the kinds shown mean; none when nothing
    is known (a single GPU, or neither nvidia-smi nor NVML could tell)."""
    linked = any(g.links for g in gpus)
    if not linked and not any(g.pcie for g in gpus):
        return []
    seen: dict[str, None] = {}
    lines = ["Links (nvidia-smi topo -m), best first:" if linked else "PCIe links:"]
    lines += [_gpu_links(g, seen, linked) for g in gpus]
    if seen:
        kinds_shown = sorted(seen, key=links.score)
        lines.append(f"  {'; '.join(f'{cell}: {links.meaning(cell)}' for cell in kinds_shown)}.")
    statuses = sorted({status for g in gpus for _, status in g.p2p} - {"OK"})
    if statuses:
        why = "; ".join(f"{status}: {links.P2P_WORDS[status]}" for status in statuses)
        lines.append(f"  No P2P: copies between those GPUs go through host memory; {why}.")
    elif any(g.p2p for g in gpus):
        lines.append("  P2P (direct copies between GPUs): OK between every pair.")
    if any(g.pcie and g.pcie.narrowed for g in gpus):
        lines.append("  Narrowed: fewer PCIe lanes than the card has (a smaller slot or a riser): copies are slower.")
    return lines


def _gpu_links(g: GpuInfo, seen: dict[str, None], linked: bool) -> str:
    """One GPU's line of ``link_lines``; the kinds of link it names are added to ``seen``."""
    kinds: dict[str, list[int]] = {}
    for other, cell in sorted(g.links, key=lambda link: (links.score(link[1]), link[0])):
        kinds.setdefault(cell, []).append(other)
        seen[cell] = None
    no_p2p: dict[str, list[int]] = {}
    for other, status in g.p2p:
        if status != "OK":
            no_p2p.setdefault(status, []).append(other)
    found = [f"{cell} to {format_ids(ids)}" for cell, ids in kinds.items()]
    found += [f"no P2P to {format_ids(ids)} ({status})" for status, ids in no_p2p.items()]
    where = [] if g.numa_node is None else [f"NUMA {g.numa_node}"]
    if g.pcie is not None:
        where.append(g.pcie.describe() + (", narrowed" if g.pcie.narrowed else ""))
    head = f"  GPU {g.index}" + (f" ({', '.join(where)})" if where else "")
    return f"{head}: {'; '.join(found) or 'unknown'}" if linked else head


def format_devices(
    gpus: list[GpuInfo], environ: Mapping[str, str], as_json: bool = False, claims: Occupancy | None = None
) -> str:
    """The ``ignite-mgpu devices`` table, or JSON with ``as_json``; ``claims`` from ``who_has``."""
    cuda = cuda_index_map(gpus, environ)
    cpu_only = all(v is None for v in cuda.values()) and visible_ids(gpus, environ) is not None
    fallback = {"backend": "gloo", "nproc": 1} if cpu_only else None
    held = claims or Occupancy()
    if as_json:
        return _as_json(gpus, cuda, fallback, held)
    if not gpus:
        return _NO_GPU_TEXT
    unknown = visible_ids(gpus, environ) is None
    unordered = len(gpus) > 1 and environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
    table = [["GPU", "PCI bus id", "Name", "Memory used/total MiB", "Util", "Procs", "Claimed by", "CUDA index"]]
    for g in gpus:
        idx = "?" if unknown else "-" if cuda[g.index] is None else f"{cuda[g.index]}{'*' if unordered else ''}"
        procs = "?" if g.n_processes < 0 else str(g.n_processes)
        if whose := sorted({held.users[pid] for pid in g.pids if pid in held.users}):
            procs += f" ({', '.join(whose)})"
        who = held.claims.get(g.index)
        claimed = "-" if who is None else f"{who.user} (pid {who.pid})" if who.known else "unknown job"
        util = "n/a" if g.utilization < 0 else f"{g.utilization}%"
        memory = f"{g.memory_used_mb} / {g.memory_total_mb}"
        table.append([str(g.index), g.pci_bus_id, g.name, memory, util, procs, claimed, idx])
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines += [f"GPU {i} is claimed by {who.describe()}." for i, who in sorted(held.claims.items())]
    for who, ids, lent in elastic_jobs(held, gpus):
        lending = f"; lent GPU {format_ids(lent)} to jobs that waited in line" if lent else ""
        lines.append(
            f"Elastic job of {who.user} (pid {who.pid}): --gpus auto:{who.gpu_range}, holds GPU {format_ids(ids)} "
            f"({len(ids)} of {who.gpu_range}){lending}."
        )
    if held.note:
        lines.append(f"Claims not shown: {held.note}")
    exported = environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if exported is None else repr(exported)
    lines.append(f"CUDA index: device number under CUDA_VISIBLE_DEVICES={shown} ('-' = hidden).")
    if unknown:
        lines.append("'?': CUDA_VISIBLE_DEVICES names GPUs by UUID/MIG id, which this table does not map.")
    if unordered:
        lines.append("*: assumes CUDA_DEVICE_ORDER=PCI_BUS_ID (unset here; CUDA then orders fastest-first).")
    if mig := [g.index for g in gpus if g.mig]:
        lines.append(
            f"GPU {format_ids(mig)}: MIG mode; CUDA sees its MIG instances (nvidia-smi -L), which --gpus cannot select."
        )
    if cpu_only:
        lines.append("Every GPU is hidden, so training would use the CPU (backend gloo, 1 process by default).")
    return "\n".join(lines + link_lines(gpus))
