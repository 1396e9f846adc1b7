"""GPU discovery and the ``--gpus`` grammar: snapshot the machine (NVML or nvidia-smi), then plan which GPUs to use.

Everything here is stdlib-only and pure except :func:`query_gpus`; torch is never imported, so the CLI starts fast.

Rule for a CUDA_VISIBLE_DEVICES already exported in the shell: ``--gpus`` takes physical ids as ``nvidia-smi``
shows them and exports CUDA_VISIBLE_DEVICES itself, so the two must not both decide. Passing ``--gpus`` while
CUDA_VISIBLE_DEVICES is exported is a ConfigError, unless the exported value is exactly what ``--gpus`` would set.
Without ``--gpus`` the exported value is kept as it is.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ignite_mgpu.errors import ConfigError

_QUERY_GPUS = "--query-gpu=index,pci.bus_id,name,memory.used,memory.total,utilization.gpu"
_GPU_ARGV = ["nvidia-smi", _QUERY_GPUS + ",mig.mode.current", "--format=csv,noheader,nounits"]
_GPU_ARGV_NO_MIG = ["nvidia-smi", _QUERY_GPUS, "--format=csv,noheader,nounits"]  # drivers that predate MIG
_APPS_ARGV = ["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid", "--format=csv,noheader"]
_GRAMMAR = "all, none, auto (1 GPU), auto:N (N >= 1), or comma-separated physical GPU ids as nvidia-smi shows them"
# GeForce RTX 40xx cards advertise PCIe peer-to-peer that hangs or corrupts NCCL collectives.
_P2P_BROKEN = re.compile(r"RTX\s*40\d\d")


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


@dataclass(frozen=True)
class GpuPlan:
    """The outcome of ``--gpus``: which physical GPUs to use and the environment that selects them."""

    physical_ids: list[int] | None  # physical ids in CUDA order (cuda:0 first); None = CPU only (gloo)
    env: dict[str, str]  # set in the launcher's os.environ before CUDA is touched and workers spawn
    messages: list[str]  # human lines to print once


def _bus(bus_id: str) -> str:
    """Normalise a PCI bus id to nvidia-smi's form, "00000000:07:00.0"; NVML may give a 4-digit domain."""
    domain, sep, rest = bus_id.strip().upper().partition(":")
    return f"{int(domain, 16):08X}:{rest}" if sep and re.fullmatch(r"[0-9A-F]+", domain) else bus_id.strip().upper()


def _run_nvidia_smi(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=15).stdout


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
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)  # NVML enumerates in PCI bus order, like nvidia-smi
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = optional(lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu, handle)
            n_proc = optional(lambda h: len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)), handle)
            bus = _bus(text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
            name = text(pynvml.nvmlDeviceGetName(handle))
            mig = mig_mode is not None and optional(lambda h: mig_mode(h)[0], handle) == 1  # (current, pending)
            gpus.append(GpuInfo(i, bus, name, mem.used // 2**20, mem.total // 2**20, util, n_proc, mig))
        return gpus
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def query_gpus(run: Callable[[list[str]], str] | None = None) -> list[GpuInfo]:
    """Snapshot the machine's NVIDIA GPUs: NVML if pynvml works, else nvidia-smi, else none.

    Args:
        run: takes an argv and returns its stdout; tests pass recorded nvidia-smi output. When given, NVML is skipped.

    Returns:
        The GPUs sorted by physical id; [] when nvidia-smi is missing or fails.
    """
    if run is None:
        gpus = _query_nvml()
        if gpus is not None:
            return gpus
        run = _run_nvidia_smi
    try:
        gpu_text, with_mig = run(_GPU_ARGV), True
    except (OSError, subprocess.SubprocessError):
        try:
            gpu_text, with_mig = run(_GPU_ARGV_NO_MIG), False
        except (OSError, subprocess.SubprocessError):
            return []
    try:  # one line per compute process: "00000000:07:00.0, 23817"
        apps = run(_APPS_ARGV).splitlines()
        procs: Counter[str] | None = Counter(_bus(line.split(",")[0]) for line in apps if "," in line)
    except (OSError, subprocess.SubprocessError):
        procs = None
    gpus = []
    for line in gpu_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        mig = with_mig and len(parts) >= 7 and parts.pop().lower() == "enabled"
        if len(parts) < 6 or not parts[0].isdigit():
            continue  # e.g. "No devices were found"
        bus = _bus(parts[1])
        used, total, util = (int(p) if p.isdigit() else -1 for p in parts[-3:])  # "[N/A]" -> -1
        n_proc = -1 if procs is None else procs[bus]
        gpus.append(GpuInfo(int(parts[0]), bus, ", ".join(parts[2:-3]), used, total, util, n_proc, mig))
    return sorted(gpus, key=lambda g: g.index)


def parse_gpus(spec: str) -> tuple[str, int | list[int] | None]:
    """Parse the one ``--gpus`` grammar: ``all | none | auto | auto:N | 2,3``.

    Returns:
        ("all", None), ("none", None), ("auto", N or None) or ("ids", [2, 3]).

    Raises:
        ConfigError: anything else, e.g. "two", "1,,2", "-1", "auto:0", "2,2".
    """
    text = spec.strip().lower()
    if text in ("all", "none", "auto"):
        return (text, None)
    if m := re.fullmatch(r"auto:(\d+)", text, re.ASCII):
        if int(m[1]) >= 1:
            return ("auto", int(m[1]))
        reason = "auto:N needs N >= 1 (use --gpus none to train on the CPU)"
    elif re.fullmatch(r"\d+(\s*,\s*\d+)*", text, re.ASCII):
        ids = [int(p) for p in text.split(",")]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if not dup:
            return ("ids", ids)
        reason = f"GPU {','.join(map(str, dup))} is listed twice"
    else:
        reason = "it is not one of the accepted forms"
    raise ConfigError(
        f"--gpus {spec!r} is invalid: {reason}. --gpus accepts {_GRAMMAR}, "
        "e.g. --gpus 2,3 or --gpus auto:2; run `ignite-mgpu devices` to list the GPU ids."
    )


def format_ids(ids: list[int]) -> str:
    """Format ids compactly: [0, 1, 2, 3] -> "0-3", [2, 3] -> "2,3"."""
    if len(ids) > 2 and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def _describe(g: GpuInfo) -> str:
    n = g.n_processes
    procs = {-1: "processes unknown", 0: "no processes", 1: "1 process"}.get(n, f"{n} processes")
    util = f", {g.utilization}% busy" if g.utilization >= 0 else ""
    return f"GPU {g.index} ({procs}, {(g.memory_total_mb - g.memory_used_mb) / 1024:.1f} GiB free{util})"


def _rank(g: GpuInfo) -> tuple[int, int, int, int]:
    """Sort key for auto: idle first (unknown next, busy last), then most free memory, least busy, lowest id."""
    busy = 0 if g.n_processes == 0 else 1 if g.n_processes < 0 else 2
    return (busy, g.memory_used_mb - g.memory_total_mb, g.utilization if g.utilization >= 0 else 101, g.index)


def visible_ids(gpus: list[GpuInfo], environ: Mapping[str, str]) -> list[int] | None:
    """Physical ids CUDA sees under environ, in CUDA order; None when CUDA_VISIBLE_DEVICES holds UUIDs/MIG names."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    known = sorted(g.index for g in gpus)
    if value is None:
        return known
    visible: list[int] = []
    for item in (p.strip() for p in value.split(",")):
        if item and not re.fullmatch(r"-?\d+", item):
            return None  # GPU-<uuid> / MIG-<uuid>: mapping them needs UUIDs, which we do not query
        if not item or int(item) not in known or int(item) in visible:
            break  # CUDA ignores an invalid entry and every entry after it
        visible.append(int(item))
    return visible


def plan_gpus(spec: str | None, gpus: list[GpuInfo], environ: Mapping[str, str], nproc: int | None = None) -> GpuPlan:
    """Turn ``--gpus`` plus a device snapshot into the physical GPUs to use and the env that selects them.

    Several GeForce RTX 40xx cards also get NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1 unless environ sets them.

    Args:
        spec: the ``--gpus`` value; None keeps CUDA_VISIBLE_DEVICES as it is. ``auto`` takes ``nproc`` GPUs when
            ``nproc`` is given, else 1; ``auto:N`` takes N. Both rank GPUs by idleness, free memory, load, id.
        gpus: the snapshot from :func:`query_gpus`.
        environ: the launcher's environment (read only).
        nproc: ``--nproc``; with ``--gpus`` it must not exceed the selected GPUs (one GPU per process). Without
            ``--gpus`` it is not checked here: only the launcher knows whether the backend needs a GPU per process.

    Raises:
        ConfigError: bad spec, unknown ids, no GPUs, too few GPUs, or a conflicting CUDA_VISIBLE_DEVICES.
    """
    messages: list[str] = []
    exported = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        visible = visible_ids(gpus, environ)
        if not gpus or visible == []:
            return GpuPlan(None, {}, [])
        if visible is None:
            visible = [g.index for g in gpus]
            messages.append(f"CUDA_VISIBLE_DEVICES={exported} is kept as exported; it names GPUs by UUID.")
        return GpuPlan(visible, _nccl_env([g for g in gpus if g.index in visible], environ, messages), messages)

    kind, arg = parse_gpus(spec)
    if kind == "none":
        selected: list[int] | None = None
    elif not gpus:
        raise ConfigError(
            f"--gpus {spec} requested but no NVIDIA GPU is visible on this machine (nvidia-smi found none); "
            "use --gpus none or leave it out to train on CPU with gloo."
        )
    elif kind == "ids":
        assert isinstance(arg, list)
        known = [g.index for g in gpus]
        if missing := [i for i in arg if i not in known]:
            which = "GPU" if len(known) == 1 else "GPUs"
            raise ConfigError(
                f"--gpus {spec}: GPU {format_ids(missing)} requested; this machine has {which} {format_ids(known)} "
                "(physical ids as nvidia-smi shows them). Pick ids from `ignite-mgpu devices`."
            )
        selected = arg
        _refuse_mig(spec, [g for g in gpus if g.index in selected])
    elif kind == "all":
        selected = [g.index for g in gpus]
        _refuse_mig(spec, gpus)
    else:
        whole = [g for g in gpus if not g.mig]  # a MIG card's memory and load are the whole card's, not a slice's
        count = arg if isinstance(arg, int) else min(nproc or 1, len(whole))
        if count > len(whole):
            mig = [g.index for g in gpus if g.mig]
            has = f"{len(whole)} it can choose from ({format_ids(mig)} in MIG mode)" if mig else str(len(whole))
            raise ConfigError(
                f"--gpus {spec} asks for {count} GPUs but this machine has {has} "
                f"(GPUs {format_ids([g.index for g in gpus])}); ask for at most {len(whole)} or "
                f"{'name the ids of cards not in MIG mode' if mig else 'use --gpus all'}."
            )
        ranked = sorted(whole, key=_rank)
        chosen, skipped = ranked[:count], ranked[count:]
        selected = sorted(g.index for g in chosen)
        line = f"--gpus {spec} chose {', '.join(_describe(g) for g in chosen)}"
        messages.append(line + (f"; skipped {', '.join(_describe(g) for g in skipped)}." if skipped else "."))
        if busy := [g for g in chosen if g.n_processes > 0]:
            messages.append(f"Not enough idle GPUs: GPU {format_ids([g.index for g in busy])} already runs other work.")

    wanted = "" if selected is None else ",".join(map(str, selected))
    if exported is not None and [p.strip() for p in exported.split(",")] != wanted.split(","):
        raise ConfigError(
            f"--gpus {spec} conflicts with CUDA_VISIBLE_DEVICES={exported!r} exported in this shell. --gpus takes "
            "physical ids as nvidia-smi shows them and sets CUDA_VISIBLE_DEVICES itself, so only one may choose: "
            "unset CUDA_VISIBLE_DEVICES, or drop --gpus to use the exported value."
        )
    if selected is None:
        return GpuPlan(None, {"CUDA_VISIBLE_DEVICES": ""}, messages)
    if nproc is not None and nproc > len(selected):
        more = f"select more GPUs (e.g. --gpus auto:{nproc})" if nproc <= len(gpus) else f"{len(gpus)} exist"
        raise ConfigError(
            f"--nproc {nproc} needs {nproc} GPUs (one per process) but --gpus {spec} selected {len(selected)} "
            f"({wanted}); {more}, lower --nproc to {len(selected)}, or use --gpus none to run CPU processes."
        )
    if environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID") != "PCI_BUS_ID":
        messages.append(
            f"Overriding CUDA_DEVICE_ORDER={environ['CUDA_DEVICE_ORDER']} with PCI_BUS_ID so --gpus ids "
            "match nvidia-smi."
        )
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": wanted}
    env.update(_nccl_env([g for g in gpus if g.index in selected], environ, messages))
    return GpuPlan(selected, env, messages)


def _refuse_mig(spec: str, selected: list[GpuInfo]) -> None:
    """A card in MIG mode is not one CUDA device: CUDA sees its MIG instances, named by UUID, and a plain index in
    CUDA_VISIBLE_DEVICES does not select them."""
    if mig := [g.index for g in selected if g.mig]:
        raise ConfigError(
            f"--gpus {spec}: GPU {format_ids(mig)} is in MIG mode, so CUDA sees its MIG instances rather than the "
            "card, and a physical id cannot select them. List the instances with `nvidia-smi -L` and export "
            "CUDA_VISIBLE_DEVICES=MIG-<uuid>[,...] without --gpus (one process per instance), or disable MIG "
            "(nvidia-smi -i N -mig 0)."
        )


def _nccl_env(selected: list[GpuInfo], environ: Mapping[str, str], messages: list[str]) -> dict[str, str]:
    """Disable NCCL P2P/IB for several RTX 40xx cards, unless the user exported the variable already."""
    if len(selected) < 2 or not any(_P2P_BROKEN.search(g.name) for g in selected):
        return {}
    env = {k: "1" for k in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE") if k not in environ}
    if env:
        messages.append(
            f"GeForce RTX 40xx GPUs selected: NCCL peer-to-peer hangs on these cards, so setting "
            f"{' '.join(f'{k}=1' for k in env)} (export a value yourself to override)."
        )
    return env


def check_cuda_not_initialized(physical_ids: list[int] | None, environ: Mapping[str, str]) -> None:
    """Refuse to go on when this process initialised CUDA with other GPUs than the plan wants.

    CUDA reads CUDA_VISIBLE_DEVICES once, at initialisation, so a later change cannot reach this process. torch is
    only inspected if already imported. A mismatch is a different GPU count than CUDA reports, or an id list in
    environ's CUDA_VISIBLE_DEVICES that differs from ``physical_ids``.

    Raises:
        ConfigError: CUDA was initialised before ``--gpus`` could take effect.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    wanted = [] if physical_ids is None else [str(i) for i in physical_ids]
    exported = environ.get("CUDA_VISIBLE_DEVICES")
    listed = None if exported is None else [p.strip() for p in exported.split(",") if p.strip()]
    if listed and not all(re.fullmatch(r"-?\d+", p) for p in listed):
        return  # GPU-<uuid> / MIG-<uuid>: cannot compare with physical ids
    if torch.cuda.device_count() != len(wanted) or (listed is not None and listed != wanted):
        raise ConfigError(
            f"CUDA was initialised in this process before --gpus could take effect (CUDA sees "
            f"{torch.cuda.device_count()} GPUs; the plan wants {','.join(wanted) or 'none'}). Pass --gpus / "
            "launch(gpus=...) before anything touches CUDA, or set CUDA_VISIBLE_DEVICES in the shell."
        )


def query_numa_affinity(run: Callable[[list[str]], str] | None = None) -> dict[int, int | None]:
    """Each GPU's NUMA node from the "NUMA Affinity" column of ``nvidia-smi topo -m`` (None where it says N/A or a
    range); {} when nvidia-smi is missing, fails or prints no such column (older drivers).

    Args:
        run: takes an argv and returns its stdout; tests pass a recorded answer.
    """
    try:
        text = (run or _run_nvidia_smi)(["nvidia-smi", "topo", "-m"])
    except (OSError, subprocess.SubprocessError):
        return {}
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # underlined headers when it believes it writes to a terminal
    lines = text.splitlines()
    header = next((ln for ln in lines if "NUMA Affinity" in ln), None)
    if header is None:
        return {}
    # Cells are tab-separated, padded with extra tabs; the row label (GPU0) has no header cell.
    column = [c.strip() for c in header.split("\t") if c.strip()].index("NUMA Affinity")
    found: dict[int, int | None] = {}
    for line in lines:
        cells = [c.strip() for c in line.split("\t") if c.strip()]
        if cells and (m := re.fullmatch(r"GPU(\d+)", cells[0])) and len(cells) > column + 1:
            value = cells[column + 1]
            found[int(m[1])] = int(value) if value.isdigit() else None
    return found
