"""The memory plan (``ignite-mgpu plan``): what one process (one GPU) holds during a training step under ddp, dp and
fsdp for the job's processes and global batch, from steps on fake tensors (``estimate.py``), and which
strategy and micro-batch fit the memory there is: the selected GPUs' free memory, or this machine's available RAM
shared by the CPU processes. How it is printed is ``table.py``'s."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from ignite_mgpu.config.schema import CheckpointConfig, Config
from ignite_mgpu.gpus import selection
from ignite_mgpu.gpus.inventory import GpuInfo, query_gpus
from ignite_mgpu.gpus.ranges import gpu_range
from ignite_mgpu.memory.estimate import Footprint, example_batch, measure
from ignite_mgpu.text import size
from ignite_mgpu.train.data.datasets import check_global_batch

MIB = 2**20
# The estimate's stated error (benchmarks/memory): a fit on a GPU keeps 15 % of the peak free.
MARGIN = 0.15
# glibc's heap held up to 54 % more than the tensors in the same benchmark: kept free on the CPU.
CPU_MARGIN = 0.55
CUDA_CONTEXT = 512 * MIB  # what CUDA's context and kernels take on each GPU before the first tensor
STRATEGY_ORDER = ("ddp", "fsdp", "dp")  # the preferred strategy first, when several fit


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The memory each process (each GPU) may use: ``free[i]`` for process i (dp: GPU i of its one process)."""

    device: str  # "cuda" or "cpu"
    # Bytes; on the CPU the available RAM divided among the processes, less each one's runtime.
    free: list[int]
    where: str  # "GPU 2,3" or "the CPU (RAM)", for the message
    # Subtracted from each before it was given here (CUDA's context, or a process's runtime)
    reserve: int
    margin: float = MARGIN  # the share of the peak a fit keeps free
    # The available RAM less the processes' own runtime: room for a GPU job's snapshot.
    host_ram: int = 0


@dataclasses.dataclass(frozen=True)
class Row:
    """One strategy's figures, per process (dp: its GPU 0)."""

    strategy: str
    processes: int
    batch: int  # samples per process and step (dp: the global batch, split over its GPUs)
    params: int
    grads: int
    optimizer: int
    activations_per_sample: int  # how much the peak grows with each sample of ``batch``
    peak: int
    # dp: GPU 0's share beyond a replica's (the whole batch's inputs, the gathered outputs)
    extra: int = 0
    block: int = 0  # fsdp: the largest unit's gathered parameters
    # On the CPU: checkpoint.async_save's copy of the saved state, in the same RAM (counted in fits)
    snapshot: int = 0
    fits: bool = False  # the whole ``batch`` fits, with MARGIN
    # The largest micro-batch per process that fits (None: not even one sample)
    micro_batch: int | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    model: str
    optimizer: str
    precision: str
    global_batch: int
    processes: int
    capacity: Capacity
    rows: list[Row]
    advice: str
    # On GPUs: checkpoint.async_save's snapshot in pinned host RAM, all processes together.
    host_snapshot: int = 0

    @property
    def nothing_fits(self) -> bool:
        """No strategy fits, not even one sample per process in micro-batches (``plan`` exits with NOTHING_FITS)."""
        return not any(r.micro_batch for r in self.rows)


def capacity(cfg: Config, environ: Mapping[str, str] = os.environ, gpus: list[GpuInfo] | None = None) -> Capacity:
    """The selected GPUs' free memory (``--gpus`` as ``train`` reads it, nothing claimed; with ``--nproc``, the
    first ``nproc`` of them, as ``train`` uses them), else the RAM."""
    snapshot = query_gpus() if gpus is None else gpus
    spec, elastic = cfg.dist.gpus, gpu_range(cfg.dist.gpus)
    if elastic is not None:  # its fewest processes: each takes the largest share of a global batch, the worst case
        spec = f"auto:{elastic.low}"
    # Given --gpus is read as train reads it: ids on a machine without GPUs are refused, not planned on the CPU.
    chosen = selection.plan_gpus(spec, snapshot, environ, cfg.dist.nproc).physical_ids if snapshot or spec else None
    if chosen and cfg.dist.nproc and cfg.dist.strategy != "dp":
        chosen = chosen[: cfg.dist.nproc]  # as the launch: local rank i on the i-th GPU, the others idle
    # Each process holds what this one holds (torch and the job's code imported); on GPUs CUDA's runtime on top.
    available, runtime = _available_ram(), _resident_bytes()
    if chosen:
        by_id = {g.index: g for g in snapshot}
        free = [max(0, (by_id[i].memory_total_mb - by_id[i].memory_used_mb) * MIB - CUDA_CONTEXT) for i in chosen]
        host = max(0, available - len(chosen) * runtime)
        where = f"GPU {','.join(map(str, chosen))}"
        if elastic is not None:
            where += f" (--gpus auto:{elastic} planned at its MIN, {elastic.low} processes)"
        return Capacity("cuda", free, where, CUDA_CONTEXT, host_ram=host)
    nproc = cfg.dist.nproc or 1
    per_process = max(0, available // nproc - runtime)
    host = max(0, available - nproc * runtime)
    return Capacity("cpu", [per_process] * nproc, "the CPU (RAM)", runtime, CPU_MARGIN, host)


def _available_ram() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")) if hasattr(os, "sysconf") else 0


def _resident_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def largest_fit(fixed: float, per_sample: float, free: int, limit: int, margin: float = MARGIN) -> int | None:
    """The largest micro-batch m <= ``limit`` with (fixed + per_sample * m) * (1 + margin) <= ``free``."""
    room = free / (1 + margin) - fixed
    if room < per_sample or room < 0:
        return None
    return limit if per_sample <= 0 else min(limit, int(room // per_sample))


def _row(strategy: str, f: Footprint, per_sample: float, cap: Capacity, block: int = 0, snapshot: int = 0) -> Row:
    fixed = f.peak - per_sample * f.batch + snapshot
    micro = largest_fit(fixed, per_sample, min(cap.free), f.batch, cap.margin)
    return Row(strategy, len(cap.free), f.batch, f.params, f.grads, f.optimizer, round(per_sample), f.peak,
               block=block, snapshot=snapshot, fits=micro == f.batch, micro_batch=micro)  # fmt: skip


def snapshot_bytes(ckpt: CheckpointConfig, whole: Footprint, own: Footprint, device: str) -> int:
    """What ``checkpoint.async_save`` keeps in RAM from the first save on, where training uses that RAM too (the
    CPU; on GPUs the snapshot is in host memory): the whole model's parameters and optimizer state on rank 0 for
    ``checkpoint.format=full`` (counted for every process: the plan fits the smallest share), each process's own
    shards for ``sharded``."""
    if device != "cpu" or not ckpt.async_save:
        return 0
    saved = whole if ckpt.format == "full" else own
    return saved.params + saved.optimizer


def host_snapshot_bytes(ckpt: CheckpointConfig, whole: Footprint, nnodes: int, device: str) -> int:
    """On GPUs, what ``checkpoint.async_save``'s snapshot takes of this machine's pinned host RAM: rank 0's whole
    state for ``full`` (on its machine), every local process's shards for ``sharded`` (this machine's share)."""
    if device != "cuda" or not ckpt.async_save:
        return 0
    nodes = nnodes if ckpt.format == "sharded" else 1
    return -(-(whole.params + whole.optimizer) // nodes)


def make_memory_plan(cfg: Config, cap: Capacity) -> MemoryPlan:
    """Measure the step (two batch sizes give the activations per sample) and fit it into ``cap``."""
    nproc, batch = len(cap.free), cfg.data.batch_size
    check_global_batch(batch, nproc)
    # The largest share sets the peak (uneven shares: 64 over 3 is 22 + 21 + 21).
    local = -(-batch // nproc)
    example, cuda = example_batch(cfg), cap.device == "cuda"
    full = measure(cfg, example, local, nproc, "ddp", cuda)
    other = max(1, local // 2) if local > 1 else 2
    per_sample = max(0.0, (full.peak - measure(cfg, example, other, nproc, "ddp", cuda).peak) / (local - other))
    rows = [_row("ddp", full, per_sample, cap, snapshot=snapshot_bytes(cfg.checkpoint, full, full, cap.device))]
    if nproc > 1:
        sharded = measure(cfg, example, local, nproc, "fsdp", cuda)
        snapshot = snapshot_bytes(cfg.checkpoint, full, sharded, cap.device)
        rows.append(_row("fsdp", sharded, per_sample, cap, block=sharded.block, snapshot=snapshot))
    else:
        rows.append(dataclasses.replace(rows[0], strategy="fsdp", note="one process: nothing to shard (as ddp)"))
    rows.append(_dataparallel(full, per_sample, cap, batch))
    host = host_snapshot_bytes(cfg.checkpoint, full, cfg.dist.nnodes, cap.device)
    told = advice(rows, cap) + host_ram_advice(host, cap.host_ram)
    return MemoryPlan(cfg.model.name, cfg.optim.name, cfg.train.precision, batch, nproc, cap, rows, told, host)


def host_ram_advice(snapshot: int, available: int) -> str:
    """A sentence for the advice when a GPU job's background checkpoint snapshot (pinned: never swapped out) would
    not fit, with MARGIN, in the host RAM available now beside the processes themselves; else nothing."""
    if not snapshot or not available or snapshot * (1 + MARGIN) <= available:
        return ""
    return (
        f" But the background checkpoint's snapshot, {size(snapshot)} of pinned host RAM from the first save on, "
        f"does not fit in the {size(available)} this machine has available beside the job's processes: set "
        "checkpoint.async_save=false (the step writes the checkpoint itself), or free RAM."
    )


def _dataparallel(ddp: Footprint, per_sample: float, cap: Capacity, batch: int) -> Row:
    """DataParallel's GPU 0, from one process's step: a replica's share of the batch, plus the whole batch's inputs
    (scattered from GPU 0) and its gathered predictions with their gradient; the replicas live on the other GPUs."""
    n = len(cap.free)
    fixed = ddp.peak - ddp.buckets - per_sample * ddp.batch  # one process: no DDP buckets
    inputs, outputs = ddp.inputs / ddp.batch, ddp.outputs / ddp.batch
    slope = per_sample / n + inputs * (1 - 1 / n) + 2 * outputs  # per sample of the global batch
    peak = round(fixed + slope * batch)
    extra = round((inputs * (1 - 1 / n) + 2 * outputs) * batch)
    if cap.device != "cuda":
        note = "needs CUDA GPUs (nn.DataParallel)"
        return Row("dp", 1, batch, ddp.params, ddp.grads, ddp.optimizer, round(slope), peak, extra, note=note)
    micro = largest_fit(fixed, slope, cap.free[0], batch, cap.margin)
    # Another GPU: a replica and its share of the activations.
    replica = ddp.params + per_sample * batch / n
    others = all(replica * (1 + cap.margin) <= free for free in cap.free[1:])
    micro = micro if others else None
    return Row("dp", 1, batch, ddp.params, ddp.grads, ddp.optimizer, round(slope), peak, extra,
               fits=micro == batch, micro_batch=micro, note=f"GPU 0 of {n}")  # fmt: skip


def advice(rows: list[Row], cap: Capacity) -> str:
    """Which strategy to run: the first of STRATEGY_ORDER whose whole batch fits, else the one that needs the fewest
    micro-batches (``train.micro_batch``), else none."""
    by_name = {r.strategy: r for r in rows if r.note != "needs CUDA GPUs (nn.DataParallel)"}
    for name in STRATEGY_ORDER:
        if name in by_name and by_name[name].fits:
            row = by_name[name]
            return f"fits: --strategy {name} with the whole batch ({row.batch} per process)."
    usable = [r for r in by_name.values() if r.micro_batch]
    if usable:
        best = max(usable, key=lambda r: (r.micro_batch or 0) / r.batch)
        return (
            f"the whole batch does not fit; --strategy {best.strategy} with train.micro_batch={best.micro_batch} "
            f"does ({best.batch} samples per process in micro-batches of {best.micro_batch}, the same global batch)."
        )
    return (
        f"nothing fits in {cap.where}, not even one sample per process: free memory, use more GPUs "
        "(fsdp shards the model over them), or a smaller model or precision."
    )
