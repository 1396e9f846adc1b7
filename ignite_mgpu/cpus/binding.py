"""CPU binding (``--cpu-binding``): which CPUs and how many intra-op threads each local rank gets, decided once in the
parent from the job's affinity mask, the topology in /sys and the GPUs (pure); each worker applies its own before
torch starts its thread pools (``affinity.py``). Torch-free, like the rest of the process layer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ignite_mgpu.cpus.topology import Topology, read_topology
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import inventory, selection
from ignite_mgpu.text import format_ids, plural

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class RankBinding:
    """One local rank's CPUs and intra-op threads."""

    # CPUs this rank is bound to (None: the affinity it was started with)
    cpus: tuple[int, ...] | None = None
    # Intra-op threads (OMP_NUM_THREADS, torch.set_num_threads); None: left as they are.
    threads: int | None = None
    # CPUs this rank counts as its own; data.num_workers=auto hands out what its threads leave.
    share: int = 1
    where: str = ""  # what the CPUs are, for the rank's log line: "cores", "NUMA node 1 of GPU 3"
    # cores: the CPUs of the process group's own threads (gloo's transport and work loops, the store): the job's
    # whole mask, so that the all-reduce runs beside the backward instead of taking turns with it on the rank's
    # share. None: they stay on ``cpus`` with the rest of the process (numa: next to the GPU).
    group_cpus: tuple[int, ...] | None = None

    def describe(self) -> str:
        """The rank's binding for its first log line ("" when it is not bound)."""
        if self.cpus is None:
            return ""
        threads = "threads as set" if self.threads is None else plural(self.threads, "intra-op thread")
        group = ""
        if self.group_cpus is not None and self.group_cpus != self.cpus:
            group = f", process-group threads on {format_ids(self.group_cpus)}"
        return f"CPUs {format_ids(self.cpus)} ({self.where}), {threads}{group}"


@dataclass(frozen=True)
class BindingPlan:
    """The binding of every local rank, and the job's one log line saying what was chosen and why."""

    mode: str = "none"  # what is applied: none, cores or numa (auto resolved)
    ranks: tuple[RankBinding, ...] = ()  # one per local rank
    reason: str = ""  # "" for --cpu-binding none: today's behaviour, nothing to say

    def rank(self, local_rank: int) -> RankBinding:
        return self.ranks[local_rank] if local_rank < len(self.ranks) else RankBinding()


class _Impossible(Exception):
    """Why a binding mode cannot apply here; an error for the explicit mode, a fallback to none for auto."""


def _cores(nproc: int, allowed: list[int], topo: Topology, threads_set: bool) -> tuple[RankBinding, ...]:
    if nproc > len(allowed):
        raise _Impossible(
            f"{plural(nproc, 'process')} need a CPU each, but this job may use {plural(len(allowed), 'CPU')} "
            f"({format_ids(allowed)}: the affinity it was started with)"
        )
    # Whole physical cores per rank where there are enough (SMT siblings stay together), else single CPUs.
    cores: dict[int, list[int]] = {}
    for cpu in allowed:
        cores.setdefault(topo.core_of.get(cpu, cpu), []).append(cpu)
    units = list(cores.values()) if len(cores) >= nproc else [[cpu] for cpu in allowed]
    per, extra = divmod(len(units), nproc)
    ranks, start = [], 0
    for r in range(nproc):
        # Contiguous; the first ranks take the remainder.
        chunk = units[start : start + per + (r < extra)]
        start += len(chunk)
        cpus = tuple(sorted(c for unit in chunk for c in unit))
        # Intra-op threads: one per physical core.
        physical = len({topo.core_of.get(c, c) for c in cpus})
        ranks.append(RankBinding(cpus, None if threads_set else physical, len(cpus), "cores", tuple(allowed)))
    return tuple(ranks)


def _numa(rank_gpus: list[list[int]], allowed: list[int], topo: Topology, threads_set: bool) -> tuple[RankBinding, ...]:
    if not topo.nodes:
        raise _Impossible("this machine exposes no NUMA information (no node*/cpulist under /sys/devices/system/node)")
    nodes_of: list[tuple[int, ...]] = []
    for local_rank, ids in enumerate(rank_gpus):
        if not ids:
            raise _Impossible(
                f"the physical GPU of local rank {local_rank} is unknown (CUDA_VISIBLE_DEVICES names GPUs by UUID, "
                "or lists fewer GPUs than processes); select the GPUs with --gpus"
            )
        found = [topo.gpu_nodes.get(g) for g in ids]
        if None in found:
            unknown = ids[found.index(None)]
            raise _Impossible(
                f"the NUMA node of GPU {unknown} is unknown (neither /sys nor nvidia-smi topo -m nor NVML says)"
            )
        nodes_of.append(tuple(sorted({n for n in found if n is not None})))
    ranks, usable = [], set(allowed)
    for ids, nodes in zip(rank_gpus, nodes_of, strict=True):
        cpus = sorted(c for n in nodes for c in topo.nodes.get(n, frozenset()) if c in usable)
        names = ",".join(map(str, nodes))
        if not cpus:
            raise _Impossible(
                f"GPU {ids[0]} sits on NUMA node {names}, whose CPUs are all outside this job's CPUs "
                f"{format_ids(allowed)}"
            )
        # Ranks bound to the same node(s) split them.
        sharing = sum(1 for other in nodes_of if other == nodes)
        physical = len({topo.core_of.get(c, c) for c in cpus})
        threads = None if threads_set else max(1, physical // sharing)
        where = f"NUMA node {names} of GPU {','.join(map(str, ids))}"
        ranks.append(RankBinding(tuple(cpus), threads, max(1, len(cpus) // sharing), where))
    return tuple(ranks)


_FIX = {
    "cores": "lower --nproc, allow the job more CPUs (taskset, the cgroup or SLURM allocation), or use "
    "--cpu-binding none to let the processes share the CPUs",
    "numa": "use --cpu-binding cores (each process its own share of the CPUs) or --cpu-binding none",
}


def plan_binding(
    mode: str,
    nproc: int,
    allowed: Iterable[int],
    environ: Mapping[str, str],
    topology: Topology | None,
    rank_gpus: list[list[int]] | None,
    external: bool = False,
) -> BindingPlan:
    """Decide every local rank's CPUs and threads: a pure function of the mode and a snapshot of the machine.

    Args:
        mode: ``dist.cpu_binding``: auto, none, cores or numa.
        nproc: the local processes.
        allowed: the CPUs this job may use: the launcher's affinity mask (taskset, cgroups, SLURM); never widened.
        environ: the launcher's environment; a set OMP_NUM_THREADS keeps its thread count, and stops ``auto``.
        topology: ``read_topology``'s snapshot (only ``none`` may pass None).
        rank_gpus: the physical GPUs each local rank drives, when the job trains on GPUs; None on the CPU.
        external: started by torchrun/SLURM, which place the processes themselves.

    Raises:
        ConfigError: ``cores`` or ``numa`` that cannot apply here (one paragraph, with the fix).
    """
    cpus = sorted(allowed)
    unbound = tuple(RankBinding(share=max(1, len(cpus) // nproc)) for _ in range(nproc))
    if mode == "none":
        return BindingPlan("none", unbound, "")
    if external:
        if mode == "auto":
            return BindingPlan("none", unbound, "cpu binding: none (auto: torchrun/SLURM placed the processes)")
        raise ConfigError(
            f"--cpu-binding {mode}: this process was started by torchrun/SLURM, which decides where its processes "
            "run; ignite-mgpu binds only the processes it starts. Bind with the outer launcher instead "
            "(torchrun --numa-binding node, srun --cpu-bind=cores), or use --cpu-binding none or auto."
        )
    assert topology is not None, "cores, numa and auto need the topology"
    if mode == "auto":
        return _auto(nproc, cpus, environ, topology, rank_gpus, unbound)
    threads_set = "OMP_NUM_THREADS" in environ
    try:
        if mode == "cores":
            ranks = _cores(nproc, cpus, topology, threads_set)
        elif rank_gpus is None:
            raise _Impossible("numa binds each rank to the CPUs of its GPU's NUMA node, but this job trains on the CPU")
        else:
            ranks = _numa(rank_gpus, cpus, topology, threads_set)
    except _Impossible as err:
        raise ConfigError(
            f"--cpu-binding {mode} (dist.cpu_binding) cannot apply here: {err}. Fix: {_FIX[mode]}."
        ) from None
    threads = f"; OMP_NUM_THREADS={environ['OMP_NUM_THREADS']} kept" if threads_set else ""
    return BindingPlan(mode, ranks, f"cpu binding: {mode} (as asked{threads})")


def _auto(
    nproc: int,
    cpus: list[int],
    environ: Mapping[str, str],
    topology: Topology,
    rank_gpus: list[list[int]] | None,
    unbound: tuple[RankBinding, ...],
) -> BindingPlan:
    """``auto``: numa for GPUs on a machine of several NUMA nodes, cores for CPU processes on the whole machine,
    else none; the line says why."""
    why = ""
    if "OMP_NUM_THREADS" in environ:
        why = f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']} is set"
    elif set(cpus) != topology.online:
        why = f"the job's affinity is already restricted to CPUs {format_ids(cpus)}"
    elif rank_gpus is not None and len(topology.nodes) < 2:
        why = "GPU training on a machine with one NUMA node"
    if why:
        return BindingPlan("none", unbound, f"cpu binding: none (auto: {why})")
    try:
        if rank_gpus is not None:
            ranks = _numa(rank_gpus, cpus, topology, False)
            why = f"GPUs on a machine with {len(topology.nodes)} NUMA nodes; each rank on its GPU's node"
            return BindingPlan("numa", ranks, f"cpu binding: numa (auto: {why})")
        ranks = _cores(nproc, cpus, topology, False)
    except _Impossible as err:
        return BindingPlan("none", unbound, f"cpu binding: none (auto: {err})")
    why = f"{plural(nproc, 'CPU process')} on {plural(len(cpus), 'CPU')} ({format_ids(cpus)}): a share each"
    return BindingPlan("cores", ranks, f"cpu binding: cores (auto: {why})")


def plan_for_job(
    mode: str,
    nproc: int,
    gpu_ids: list[int] | None,
    on_gpu: bool,
    strategy: str,
    environ: Mapping[str, str],
    external: bool = False,
    allowed: set[int] | None = None,
) -> BindingPlan:
    """``plan_binding`` for this machine: reads the affinity (unless ``allowed`` is given), /sys and, for GPU jobs,
    the GPU snapshot (each GPU's NUMA node where /sys does not say it).

    ``gpu_ids`` are the physical GPUs in CUDA order (None: as CUDA_VISIBLE_DEVICES has them); local rank k drives
    cuda:k, or every GPU with ``strategy="dp"``.
    """
    allowed = allowed if allowed is not None else os.sched_getaffinity(0)
    if mode == "none" or external:
        return plan_binding(mode, nproc, allowed, environ, None, None, external)
    rank_gpus, buses = None, {}
    snapshot: list[inventory.GpuInfo] = []
    if on_gpu:
        snapshot = inventory.query_gpus()
        ids = gpu_ids if gpu_ids is not None else selection.plan_gpus(None, snapshot, environ).physical_ids or []
        if gpu_ids is None and not environ.get("CUDA_VISIBLE_DEVICES", "0").replace(",", "").isdigit():
            # GPUs named by UUID: which physical GPU cuda:k is cannot be told from the snapshot.
            ids = []
        rank_gpus = [ids] if strategy == "dp" else [ids[k : k + 1] for k in range(nproc)]
        buses = {g.index: g.pci_bus_id for g in snapshot if g.index in ids}
    topology = read_topology(allowed, buses)
    if any(node is None for node in topology.gpu_nodes.values()):
        # Where /sys does not say: the node the snapshot read (nvidia-smi topo -m or NVML), not asked again.
        asked = {g.index: g.numa_node for g in snapshot}
        known = {g: topology.gpu_nodes[g] if topology.gpu_nodes[g] is not None else asked.get(g) for g in buses}
        topology = Topology(topology.online, topology.nodes, topology.core_of, known)
    return plan_binding(mode, nproc, allowed, environ, topology, rank_gpus)
