"""Which of a job's GPUs failed, after a failure: those that nvidia-smi no longer lists or reports lost, and the GPU
of each rank whose error is a CUDA device error (the device itself failed, not the program on it). Pure over the
snapshot and the ranks' errors; the supervisor acts on the answer (``processes/elastic.py``). Torch-free."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ignite_mgpu.gpus.claims import claim_name
from ignite_mgpu.gpus.inventory import GpuInfo

# What CUDA, NCCL and the driver say when the device itself failed, not the program on it (NVIDIA's Xid catalogue:
# 79 "fallen off the bus", 48/94/95 ECC errors, 13/31/43 launch failures that a bad device also gives; CUDA's
# cudaErrorUnknown).
DEVICE_ERROR = re.compile(
    r"fallen off the bus|GPU is lost|\bXid\b|unspecified launch failure|uncorrectable ECC|ECC error|"
    r"CUDA error: unknown error",  # what NCCL's watchdog reports of a GPU that fell off the bus (Xid 79)
    re.IGNORECASE,
)
# What nvidia-smi writes in the fields of a GPU that it still lists but cannot read.
_LOST_FIELDS = re.compile(r"GPU is lost|Unknown Error", re.IGNORECASE)


@dataclass(frozen=True)
class Lost:
    """One of the job's GPUs, found gone or unhealthy after a failure."""

    physical_id: int
    reason: str  # "nvidia-smi no longer lists it", "rank 2's error is a CUDA device error (...)"


def device_error(text: str) -> str | None:
    """The phrase of ``text`` that names a failed device (``DEVICE_ERROR``), or None."""
    found = DEVICE_ERROR.search(text)
    return found[0] if found else None


def lost_gpus(
    gpus: Sequence[int],
    names: Mapping[int, str],
    failures: Sequence[Mapping[str, Any]],
    snapshot: Sequence[GpuInfo] | None,
    first_rank: int = 0,
    one_per_rank: bool = True,
) -> list[Lost]:
    """The GPUs of ``gpus`` (physical ids in CUDA order; ``names``: their claim names) that failed: those the
    snapshot no longer lists or reports lost (an empty or missing snapshot tells nothing: nvidia-smi itself may
    fail with a lost GPU), and the GPU of each rank whose error (its failure file: rank, time, message, traceback)
    names a device failure. ``first_rank``: the global rank of local rank 0; ``one_per_rank=False`` (one process
    driving several GPUs, ``dp``): an error cannot say which GPU it came from."""
    found: dict[int, str] = {}
    if snapshot:
        listed = {claim_name(g.uuid, g.pci_bus_id): g for g in snapshot}
        for index in gpus:
            if index not in names:
                continue  # not known by name (CUDA_VISIBLE_DEVICES as exported): only its rank's error can tell
            gpu = listed.get(names[index])
            if gpu is None:
                found[index] = "nvidia-smi no longer lists it"
            elif _LOST_FIELDS.search(gpu.name):
                found[index] = f"nvidia-smi reports it lost ({gpu.name})"
    for failure in sorted(failures, key=lambda f: f.get("time", 0)):
        text = f"{failure.get('message', '')}\n{failure.get('traceback', '')}"
        local = int(failure.get("rank", -1)) - first_rank
        if (phrase := device_error(text)) and one_per_rank and 0 <= local < len(gpus):
            found.setdefault(gpus[local], f"rank {failure['rank']}'s error is a CUDA device error ({phrase!r})")
    return [Lost(index, why) for index, why in sorted(found.items())]
