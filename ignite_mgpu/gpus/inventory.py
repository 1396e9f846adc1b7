"""GPU discovery: a snapshot of the machine's NVIDIA GPUs (NVML, else nvidia-smi), how they are linked
(``links.py``), whether each pair has P2P and each GPU's PCIe link (``pcie.py``), and their NUMA nodes. Which of them
a job uses is ``selection.py``'s. Stdlib only: torch is never imported, so the CLI starts fast.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ignite_mgpu.gpus import links as gpu_links
from ignite_mgpu.gpus import pcie as gpu_pcie

_QUERY_GPUS = "--query-gpu=index,pci.bus_id,name,memory.used,memory.total,utilization.gpu"
# The UUID comes last, where a recording without it (older answers) leaves the other columns as they were.
_GPU_ARGV = ["nvidia-smi", _QUERY_GPUS + ",mig.mode.current,uuid", "--format=csv,noheader,nounits"]
# Drivers older than MIG know no mig.mode field and refuse the query: asked again without it.
_GPU_ARGV_NO_MIG = ["nvidia-smi", _QUERY_GPUS + ",uuid", "--format=csv,noheader,nounits"]
_APPS_ARGV = ["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid", "--format=csv,noheader"]
# nvidia-smi's exit code when a GPU "has fallen off the bus or has otherwise become inaccessible" (its manual page):
# it still prints the rows of the GPUs that answer, and "Unable to determine the device handle for GPU<bus>: GPU is
# lost.  Reboot the system to recover this GPU" for the lost one, which the snapshot leaves out.
GPU_LOST_EXIT = 15


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML / nvidia-smi reports it."""

    index: int  # physical id as nvidia-smi shows it (PCI bus order)
    pci_bus_id: str  # e.g. "00000000:07:00.0"
    name: str  # e.g. "NVIDIA A100-SXM4-80GB"
    memory_used_mb: int  # MiB in use (-1 if unknown)
    memory_total_mb: int  # MiB on the card (-1 if unknown)
    utilization: int  # percent, -1 if unknown
    n_processes: int  # compute processes on it, -1 if unknown
    mig: bool = False  # in MIG mode: CUDA sees its MIG instances (nvidia-smi -L), not the card
    uuid: str = ""  # "GPU-8a0e..." (claims.py names the GPU by it); "" if unknown
    pids: tuple[int, ...] = ()  # its compute processes, as far as listed
    # Its link to each other GPU (physical id, as nvidia-smi topo -m prints it: "NV12", "PIX", "SYS"); () unknown
    links: tuple[tuple[int, str], ...] = ()
    numa_node: int | None = None  # the NUMA node nvidia-smi topo -m (or NVML) gives it; None if unknown
    # Whether it may read each other GPU's memory directly, as topo -p2p r prints it ("OK", "CNS"); () unknown
    p2p: tuple[tuple[int, str], ...] = ()
    pcie: gpu_pcie.PcieLink | None = None  # its PCIe link: generation and width, now and at most; None if unknown

    def link_to(self, other: int) -> str | None:
        """The link to GPU ``other`` as topo -m prints it; None if unknown."""
        return dict(self.links).get(other)

    def path_to(self, other: int) -> str | None:
        """The link to GPU ``other`` as the choice ranks it: with the P2P status where that is not OK ("PIX CNS")."""
        return gpu_links.with_p2p(self.link_to(other), dict(self.p2p).get(other))


def _bus(bus_id: str) -> str:
    """Normalise a PCI bus id to nvidia-smi's form, "00000000:07:00.0"; NVML may give a 4-digit domain."""
    domain, sep, rest = bus_id.strip().upper().partition(":")
    return f"{int(domain, 16):08X}:{rest}" if sep and re.fullmatch(r"[0-9A-F]+", domain) else bus_id.strip().upper()


def _run_nvidia_smi(argv: list[str]) -> str:
    """nvidia-smi's answer; its rows also when a GPU is lost (``GPU_LOST_EXIT``): the others are still there."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=15)
    if done.returncode not in (0, GPU_LOST_EXIT):
        raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
    return done.stdout


def _query_nvml() -> list[GpuInfo] | None:
    """Ask NVML through pynvml; None when pynvml is missing or NVML cannot start."""
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None

    def optional(call: Callable[[object], int], handle: object) -> int:
        try:
            return call(handle)
        except pynvml.NVMLError:  # MIG slices and some consumer cards do not report everything
            return -1

    def text(value: str | bytes) -> str:  # older pynvml returns bytes
        return value.decode() if isinstance(value, bytes) else value

    mig_mode = getattr(pynvml, "nvmlDeviceGetMigMode", None)  # absent from old pynvml releases
    uuid_of = getattr(pynvml, "nvmlDeviceGetUUID", lambda handle: "")
    try:
        gpus, handles = [], {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            # NVML enumerates in PCI bus order, like nvidia-smi.
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                bus = _bus(text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
                name = text(pynvml.nvmlDeviceGetName(handle))
            except pynvml.NVMLError:  # this device only (NVML_ERROR_GPU_IS_LOST): the others still answer
                continue
            util = optional(lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu, handle)
            try:
                running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                n_proc, pids = len(running), tuple(p.pid for p in running if isinstance(getattr(p, "pid", None), int))
            except pynvml.NVMLError:
                n_proc, pids = -1, ()
            # (current, pending)
            mig = mig_mode is not None and optional(lambda h: mig_mode(h)[0], handle) == 1
            try:
                uuid = text(uuid_of(handle))
            except pynvml.NVMLError:
                uuid = ""
            gpus.append(GpuInfo(i, bus, name, mem.used // 2**20, mem.total // 2**20, util, n_proc, mig, uuid, pids))
            handles[i] = handle
        return _nvml_links(pynvml, gpus, handles)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_links(pynvml: Any, gpus: list[GpuInfo], handles: dict[int, Any]) -> list[GpuInfo]:
    """The snapshot with what NVML tells of each GPU's place: its PCIe link and NUMA node, and with two GPUs or
    more each pair's link and P2P status."""
    found: dict[int, dict[int, str]] = {}
    p2p: dict[int, dict[int, str]] = {}
    if len(gpus) > 1:
        at = {g.pci_bus_id: g.index for g in gpus}
        found = gpu_links.read_nvml(
            pynvml, handles, lambda bus: at.get(_bus(bus.decode() if isinstance(bus, bytes) else bus))
        )
        p2p = gpu_pcie.read_nvml_p2p(pynvml, handles)
    return [
        dataclasses.replace(
            g,
            links=tuple(sorted(found.get(g.index, {}).items())),
            p2p=tuple(sorted(p2p.get(g.index, {}).items())),
            pcie=gpu_pcie.read_nvml_pcie(pynvml, handles[g.index]),
            numa_node=_nvml_numa(pynvml, handles[g.index]),
        )
        for g in gpus
    ]


def _nvml_numa(pynvml: Any, handle: Any) -> int | None:
    """The NUMA node whose memory is nearest the GPU (what topo -m calls its NUMA Affinity); None unless one."""
    affinity = getattr(pynvml, "nvmlDeviceGetMemoryAffinity", None)
    if affinity is None:
        return None
    try:
        words = affinity(handle, 4, 0)  # 4 x 64 bits: up to 256 nodes; scope 0 = NVML_AFFINITY_SCOPE_NODE
    except pynvml.NVMLError:
        return None
    nodes = [64 * i + bit for i, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1]
    return nodes[0] if len(nodes) == 1 else None


def _with_links(gpus: list[GpuInfo], run: Callable[[list[str]], str]) -> list[GpuInfo]:
    """The snapshot with each GPU's links and NUMA node (``nvidia-smi topo -m``), P2P (``topo -p2p r``) and PCIe link
    (``--query-gpu``), where NVML did not tell them; a single GPU: nothing asked."""
    if len(gpus) < 2:
        return gpus
    matrix = gpu_links.read_matrix(run)
    # A driver that cannot answer topo -m knows no topo -p2p either.
    p2p = gpu_pcie.read_p2p(run) if matrix.links and not any(g.p2p for g in gpus) else {}
    pcie = gpu_pcie.read_pcie(run) if all(g.pcie is None for g in gpus) else {}
    return [
        dataclasses.replace(
            g,
            links=tuple(sorted(matrix.links.get(g.index, {}).items())),
            numa_node=g.numa_node if g.numa_node is not None else matrix.numa.get(g.index),
            p2p=g.p2p or tuple(sorted(p2p.get(g.index, {}).items())),
            pcie=g.pcie or pcie.get(g.index),
        )
        for g in gpus
    ]


def query_gpus(run: Callable[[list[str]], str] | None = None) -> list[GpuInfo]:
    """Snapshot the machine's NVIDIA GPUs: NVML if pynvml works, else nvidia-smi, else none; with how they are
    linked (NVML's answer, else ``nvidia-smi topo -m``; unknown when neither tells).

    Args:
        run: takes an argv and returns its stdout; tests pass recorded nvidia-smi output. When given, NVML is skipped.

    Returns:
        The GPUs sorted by physical id; [] when nvidia-smi is missing or fails.
    """
    if run is None:
        gpus = _query_nvml()
        if gpus is not None:
            return gpus if any(g.links for g in gpus) else _with_links(gpus, _run_nvidia_smi)
        run = _run_nvidia_smi
    try:
        gpu_text, with_mig = run(_GPU_ARGV), True
    except (OSError, subprocess.SubprocessError):
        try:
            gpu_text, with_mig = run(_GPU_ARGV_NO_MIG), False
        except (OSError, subprocess.SubprocessError):
            return []
    procs = _compute_apps(run)
    gpus = []
    for line in gpu_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        uuid = parts.pop() if len(parts) >= 7 and parts[-1].startswith(("GPU-", "gpu-")) else ""
        mig = with_mig and len(parts) >= 7 and parts.pop().lower() == "enabled"
        if len(parts) < 6 or not parts[0].isdigit():
            continue  # e.g. "No devices were found"
        bus = _bus(parts[1])
        used, total, util = (int(p) if p.isdigit() else -1 for p in parts[-3:])  # "[N/A]" -> -1
        listed = [] if procs is None else procs.get(bus, [])
        pids, n_proc = tuple(p for p in listed if p > 0), -1 if procs is None else len(listed)
        name = ", ".join(parts[2:-3])
        gpus.append(GpuInfo(int(parts[0]), bus, name, used, total, util, n_proc, mig, uuid, pids))
    return _with_links(sorted(gpus, key=lambda g: g.index), run)


def _compute_apps(run: Callable[[list[str]], str]) -> dict[str, list[int]] | None:
    """Each GPU's compute processes by bus id, from lines such as "00000000:07:00.0, 23817"; None if unknown."""
    try:
        apps = run(_APPS_ARGV).splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    procs: dict[str, list[int]] = {}
    for line in apps:
        bus, sep, pid = line.partition(",")
        if sep:
            procs.setdefault(_bus(bus), []).append(int(pid) if pid.strip().isdigit() else -1)
    return procs
