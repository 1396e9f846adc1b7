"""Which of a job's GPUs failed, after a failure: those that nvidia-smi no longer lists or reports lost, those the
kernel's log blames (the driver's Xid of a hardware fault, "fallen off the bus"), and the GPU of each rank whose error
is a CUDA device error (the device itself failed, not the program on it). Pure over the snapshot, the kernel's
records and the ranks' errors (``kernel_faults`` reads the log, where it is readable); the supervisor acts on the
answer (``processes/elastic.py``). Torch-free."""

from __future__ import annotations

import errno
import os
import re
import stat
import time
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
# The driver's Xids that mean the device itself failed (NVIDIA's Xid catalogue), not the program on it (13, 31, 43).
HARDWARE_XIDS = {
    48: "double-bit ECC error",
    63: "ECC page retirement",
    64: "ECC page retirement failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP timeout",
    120: "GSP error",
}
_XID = re.compile(r"NVRM: Xid \(PCI:(?P<bus>[0-9a-f]+:[0-9a-f]+:[0-9a-f]+)[^)]*\): (?P<code>\d+)", re.IGNORECASE)
# Newer drivers say it in several records: "NVRM: The NVIDIA GPU 0000:b3:00.0", ..., "fallen off the bus".
_THE_GPU = re.compile(r"NVRM: The NVIDIA GPU (?P<bus>[0-9a-f]+:[0-9a-f]+:[0-9a-f]+)", re.IGNORECASE)
KMSG = "/dev/kmsg"  # character device 1:11
_MOST_BYTES = 32 << 20  # the kernel's ring holds at most a few MiB; a regular file stand-in is read no further
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
    kernel: Mapping[str, str] | None = None,
) -> list[Lost]:
    """The GPUs of ``gpus`` (physical ids in CUDA order; ``names``: their claim names) that failed: those the
    snapshot no longer lists or reports lost (an empty or missing snapshot tells nothing: nvidia-smi itself may
    fail with a lost GPU), those whose bus the kernel's log blames (``kernel``: ``kernel_faults``), and the GPU of
    each rank whose error (its failure file: rank, time, message, traceback) names a device failure.
    ``first_rank``: the global rank of local rank 0; ``one_per_rank=False`` (one process driving several GPUs,
    ``dp``): an error cannot say which GPU it came from."""
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
            elif why := (kernel or {}).get(bus_key(gpu.pci_bus_id)):
                found[index] = f"the kernel's log reports {why}"
    for failure in sorted(failures, key=lambda f: f.get("time", 0)):
        text = f"{failure.get('message', '')}\n{failure.get('traceback', '')}"
        local = int(failure.get("rank", -1)) - first_rank
        if (phrase := device_error(text)) and one_per_rank and 0 <= local < len(gpus):
            found.setdefault(gpus[local], f"rank {failure['rank']}'s error is a CUDA device error ({phrase!r})")
    return [Lost(index, why) for index, why in sorted(found.items())]


def bus_key(bus: str) -> str:
    """A PCI bus id as ``domain:bus:device`` in lower-case hex without padding: nvidia-smi's ``00000000:3B:00.0``
    and the driver's ``0000:3b:00`` alike."""
    parts = re.findall(r"[0-9a-fA-F]+", bus)[:3]
    return ":".join(f"{int(part, 16):x}" for part in parts)


def kernel_faults(since: float, path: str = KMSG) -> dict[str, str]:
    """The GPUs' hardware faults in the kernel's log since ``since`` (a ``time.time()``): ``bus_key`` -> "Xid 79
    (GPU has fallen off the bus)". Read without blocking and bounded (``/dev/kmsg``, one record per read); {} where
    the log is not readable (``kernel.dmesg_restrict`` for a user) or not a log."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        info = os.fstat(fd)
        kmsg = stat.S_ISCHR(info.st_mode) and (os.major(info.st_rdev), os.minor(info.st_rdev)) == (1, 11)
        if not (kmsg or stat.S_ISREG(info.st_mode)):  # a FIFO, /dev/zero: not a log
            return {}
        return _faults_in(_records(fd), since - (time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)))
    finally:
        os.close(fd)


def _records(fd: int) -> list[str]:
    """Each record read (``priority,sequence,microseconds,flags;text``), until there is none left."""
    found: list[str] = []
    pending, left = "", _MOST_BYTES
    while left > 0 and len(pending) < 1 << 16:  # a record is at most 8 KiB
        try:
            chunk = os.read(fd, 8192)
        except OSError as err:
            if err.errno == errno.EPIPE:  # the record was overwritten while read: the next one follows
                continue
            break  # EAGAIN: none left
        if not chunk:
            break
        left -= len(chunk)
        lines = (pending + chunk.decode(errors="replace")).split("\n")
        pending = lines.pop()
        found += [line for line in lines if line and not line.startswith(" ")]  # " KEY=value": a record's dict
    return found


def _faults_in(records: list[str], since_boot: float) -> dict[str, str]:
    found: dict[str, str] = {}
    gpu = None  # the bus of the last "The NVIDIA GPU <bus>" record
    for record in records:
        head, _, text = record.partition(";")
        fields = head.split(",")
        if len(fields) < 3 or not fields[2].isdigit() or int(fields[2]) / 1e6 < since_boot:
            continue
        if (xid := _XID.search(text)) and int(xid["code"]) in HARDWARE_XIDS:
            code = int(xid["code"])
            found.setdefault(bus_key(xid["bus"]), f"Xid {code} ({HARDWARE_XIDS[code]})")
        elif the_gpu := _THE_GPU.search(text):
            gpu = bus_key(the_gpu["bus"])
        elif gpu is not None and "fallen off the bus" in text:
            found.setdefault(gpu, "that it has fallen off the bus")
    return found
