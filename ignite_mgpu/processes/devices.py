"""The ``ignite-mgpu devices`` table: every GPU of the snapshot, what runs on it, and its CUDA index under this
environment's CUDA_VISIBLE_DEVICES. Torch-free."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict

from ignite_mgpu.processes.gpu_selection import visible_ids
from ignite_mgpu.processes.gpus import GpuInfo
from ignite_mgpu.text import format_ids

_NO_GPU_TEXT = (
    "No NVIDIA GPU found (nvidia-smi not available or shows none). "
    "Training would use the CPU: backend gloo, 1 process by default (--nproc N to change)."
)


def cuda_index_map(gpus: list[GpuInfo], environ: Mapping[str, str]) -> dict[int, int | None]:
    """Map each physical id to its CUDA index under environ's CUDA_VISIBLE_DEVICES (None = hidden or unknown).

    The mapping assumes CUDA_DEVICE_ORDER=PCI_BUS_ID, which the launcher sets whenever ``--gpus`` is given.
    Without it CUDA numbers devices fastest-first, which agrees with nvidia-smi only when all GPUs are the
    same model. When CUDA_VISIBLE_DEVICES holds UUIDs or MIG names every value is None (cannot tell).
    """
    visible = visible_ids(gpus, environ) or []
    return {g.index: visible.index(g.index) if g.index in visible else None for g in gpus}


def format_devices(gpus: list[GpuInfo], environ: Mapping[str, str], as_json: bool = False) -> str:
    """The ``ignite-mgpu devices`` table, or JSON with ``as_json``."""
    cuda = cuda_index_map(gpus, environ)
    cpu_only = all(v is None for v in cuda.values()) and visible_ids(gpus, environ) is not None
    fallback = {"backend": "gloo", "nproc": 1} if cpu_only else None
    if as_json:
        rows = [{**asdict(g), "cuda_index": cuda[g.index]} for g in gpus]
        return json.dumps({"gpus": rows, "cpu_fallback": fallback}, indent=2)
    if not gpus:
        return _NO_GPU_TEXT
    unknown = visible_ids(gpus, environ) is None
    unordered = len(gpus) > 1 and environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
    table = [["GPU", "PCI bus id", "Name", "Memory used/total MiB", "Util", "Procs", "CUDA index"]]
    for g in gpus:
        idx = "?" if unknown else "-" if cuda[g.index] is None else f"{cuda[g.index]}{'*' if unordered else ''}"
        procs = "?" if g.n_processes < 0 else str(g.n_processes)
        util = "n/a" if g.utilization < 0 else f"{g.utilization}%"
        memory = f"{g.memory_used_mb} / {g.memory_total_mb}"
        table.append([str(g.index), g.pci_bus_id, g.name, memory, util, procs, idx])
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
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
    return "\n".join(lines)
