"""Leaving out a failed GPU: after a failure that a restart can cure, whether one of the job's GPUs is gone or
unhealthy (nvidia-smi no longer lists it or reports it lost, or the failed rank's error is a CUDA device error),
and what the restart does about it. A job on ``--gpus auto:MIN-MAX`` restarts on the GPUs left (never below MIN)
and lets go of the lost one's claim; any other job restarts as before, told that a range would have continued.
The restart resumes the newest checkpoint, which any number of processes continues as the same run. Torch-free."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from ignite_mgpu.gpus import inventory
from ignite_mgpu.gpus.claims import claim_name
from ignite_mgpu.processes.outcome import Failure
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.processes.resize import with_gpus
from ignite_mgpu.text import format_ids, plural

# What CUDA, NCCL and the driver say when the device itself failed, not the program on it (NVIDIA's Xid catalogue:
# 79 "fallen off the bus", 48/94/95 ECC errors, 13/31/43 launch failures that a bad device also gives).
DEVICE_ERROR = re.compile(
    r"fallen off the bus|GPU is lost|\bXid\b|unspecified launch failure|uncorrectable ECC|ECC error",
    re.IGNORECASE,
)
# What nvidia-smi writes in the fields of a GPU that it still lists but cannot read.
_LOST_FIELDS = re.compile(r"GPU is lost|Unknown Error", re.IGNORECASE)


@dataclass(frozen=True)
class Lost:
    """One of the job's GPUs, found gone or unhealthy after a failure."""

    physical_id: int
    reason: str  # "nvidia-smi no longer lists it", "rank 2's error is a CUDA device error (...)"


@dataclass(frozen=True)
class Resize:
    """What the restart does about lost GPUs: ``plan`` to restart on (None: the same plan), the claims to let go,
    the line for the log, and why the job cannot restart at all (None: it can)."""

    lost: list[Lost]
    line: str
    plan: LaunchPlan | None = None
    released: list[str] = dataclasses.field(default_factory=list)
    refusal: str | None = None


def device_error(text: str) -> str | None:
    """The phrase of ``text`` that names a failed device (``DEVICE_ERROR``), or None."""
    found = DEVICE_ERROR.search(text)
    return found[0] if found else None


def lost_gpus(plan: LaunchPlan, failures: list[Failure], snapshot: list[inventory.GpuInfo] | None) -> list[Lost]:
    """The job's GPUs that failed: those the snapshot no longer lists or reports lost (an empty or missing snapshot
    tells nothing: nvidia-smi itself may fail with a lost GPU), and the GPU of each rank whose error names a device
    failure. One process driving several GPUs (``dp``) cannot say which GPU its error came from."""
    ids, found = plan.gpus or [], {}
    if snapshot:
        listed = {claim_name(g.uuid, g.pci_bus_id): g for g in snapshot}
        for index in ids:
            if index not in plan.gpu_names:
                continue  # not known by name (CUDA_VISIBLE_DEVICES as exported): only its rank's error can tell
            gpu = listed.get(plan.gpu_names[index])
            if gpu is None:
                found[index] = "nvidia-smi no longer lists it"
            elif _LOST_FIELDS.search(gpu.name):
                found[index] = f"nvidia-smi reports it lost ({gpu.name})"
    offset = plan.node_rank * plan.nproc
    for failure in sorted(failures, key=lambda f: f.get("time", 0)):
        text = f"{failure.get('message', '')}\n{failure.get('traceback', '')}"
        local = int(failure.get("rank", -1)) - offset
        if (phrase := device_error(text)) and plan.strategy != "dp" and 0 <= local < len(ids):
            found.setdefault(ids[local], f"rank {failure['rank']}'s error is a CUDA device error ({phrase!r})")
    return [Lost(index, why) for index, why in sorted(found.items())]


def leave_out(
    plan: LaunchPlan,
    failures: list[Failure],
    query: Callable[[], list[inventory.GpuInfo]] = inventory.query_gpus,
) -> Resize | None:
    """After a failure that a restart can cure: None when none of the job's GPUs failed (or it chose none), else
    the restart's plan on the GPUs left, or the line saying what a range would have done."""
    if not plan.gpus or plan.external:
        return None
    lost = lost_gpus(plan, failures, query())
    if not lost:
        return None
    gone = [x.physical_id for x in lost]
    named = "; ".join(f"GPU {x.physical_id} ({x.reason})" for x in lost)
    left = [i for i in plan.gpus if i not in gone]
    elastic = plan.gpu_range
    if elastic is None:
        maybe = f"--gpus auto:{max(1, len(left))}-{len(plan.gpus)}" if left else "a range of GPUs"
        return Resize(lost, f"failed: {named}. The restart runs on the same GPUs; {maybe} would have continued "
                      f"on {'GPU ' + format_ids(left) if left else 'other GPUs'} without it.")  # fmt: skip
    if len(left) < elastic.low:
        refusal = (
            f"{named} failed, leaving {plural(len(left), 'GPU')}, below the range's MIN {elastic.low} "
            f"(--gpus auto:{elastic})"
        )
        return Resize(lost, f"{refusal}.", refusal=refusal)
    smaller = with_gpus(plan, {i: name for i, name in plan.gpu_names.items() if i in left})
    nproc = smaller.nproc
    released = [plan.gpu_names[i] for i in gone if i in plan.gpu_names]
    line = (
        f"left out {named}; its claim is released, and the restart continues on GPU {format_ids(left)} "
        f"({plural(nproc, 'process')}, was {plan.nproc}; --gpus auto:{elastic})."
    )
    return Resize(lost, line, smaller, released)
