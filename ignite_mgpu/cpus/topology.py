"""What /sys says about the machine's CPUs (online, NUMA nodes, SMT siblings) and its GPUs' NUMA nodes: a snapshot,
so that planning the CPU binding (``binding.py``) is a pure function of it. Torch-free."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

SYS = "/sys"  # tests point this at a fake tree


def parse_cpulist(text: str) -> set[int]:
    """The kernel's cpulist format, "0-3,8,10-11", as a set of CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part.strip():
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


@dataclass(frozen=True)
class Topology:
    """What /sys says about the CPUs and GPUs: a snapshot, so that planning is a pure function of it."""

    online: frozenset[int]  # every online CPU of the machine
    # NUMA node -> its CPUs; only nodes with CPUs; {} without NUMA information.
    nodes: dict[int, frozenset[int]]
    core_of: dict[int, int]  # CPU -> the lowest CPU of its physical core (SMT siblings share it)
    gpu_nodes: dict[int, int | None]  # physical GPU id -> its NUMA node (None: unknown)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_topology(cpus: Iterable[int], gpu_buses: Mapping[int, str], root: str | None = None) -> Topology:
    """Read the topology of ``cpus`` (their SMT siblings) and of the GPUs ``gpu_buses`` (physical id -> PCI bus id
    as nvidia-smi prints it, "00000000:07:00.0") from ``root`` (default /sys)."""
    base = Path(root or SYS)
    online_text = _read(base / "devices/system/cpu/online")
    online = parse_cpulist(online_text) if online_text else set(range(os.cpu_count() or 1))
    nodes = {}
    for cpulist in sorted((base / "devices/system/node").glob("node[0-9]*/cpulist")):
        node_cpus = parse_cpulist(_read(cpulist) or "")
        if node_cpus:  # memory-only nodes (HBM, CXL) hold no CPU to bind to
            nodes[int(cpulist.parent.name[4:])] = frozenset(node_cpus)
    core_of = {}
    for cpu in cpus:
        siblings = _read(base / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        core_of[cpu] = min(parse_cpulist(siblings)) if siblings else cpu
    gpu_nodes: dict[int, int | None] = {}
    for gpu, bus in gpu_buses.items():
        domain, _, rest = bus.lower().partition(":")  # sysfs names the device 0000:07:00.0
        text = _read(base / f"bus/pci/devices/{int(domain, 16):04x}:{rest}/numa_node")
        node = int(text) if text and text.strip().lstrip("-").isdigit() else None
        # -1: the firmware did not say; on a machine with one node that can only be node 0.
        gpu_nodes[gpu] = node if node is not None and node >= 0 else (next(iter(nodes)) if len(nodes) == 1 else None)
    return Topology(frozenset(online), nodes, core_of, gpu_nodes)
