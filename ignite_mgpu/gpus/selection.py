"""The ``--gpus`` grammar and which GPUs a job uses: a pure function of the spec, the GPU snapshot (``inventory.py``)
and the launcher's environment, giving the physical ids and the environment that selects them.

Rule for a CUDA_VISIBLE_DEVICES already exported in the shell: ``--gpus`` takes physical ids as ``nvidia-smi``
shows them and exports CUDA_VISIBLE_DEVICES itself, so the two must not both decide. Passing ``--gpus`` while
CUDA_VISIBLE_DEVICES is exported is a ConfigError, unless the exported value is exactly what ``--gpus`` would set.
Without ``--gpus`` the exported value is kept as it is. Torch-free (torch is only inspected if already imported).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import choice
from ignite_mgpu.gpus.claims import claim_name
from ignite_mgpu.gpus.inventory import GpuInfo
from ignite_mgpu.gpus.ranges import GpuRange, parse_range
from ignite_mgpu.text import format_ids, plural

_GRAMMAR = (
    "all, none, auto (1 GPU), auto:N (N >= 1), auto:MIN-MAX (as many free GPUs as there are, from MIN to MAX), or "
    "comma-separated physical GPU ids as nvidia-smi shows them"
)
# GeForce RTX 40xx cards advertise PCIe peer-to-peer that hangs or corrupts NCCL collectives.
_P2P_BROKEN = re.compile(r"RTX\s*40\d\d")


class GpusTaken(ConfigError):
    """The GPUs asked for are claimed by other jobs (or, while waiting, not free): ``--wait`` waits this one out."""


@dataclass(frozen=True)
class GpuPlan:
    """The outcome of ``--gpus``: which physical GPUs to use and the environment that selects them."""

    # Physical ids in CUDA order (cuda:0 first); None = CPU only (gloo)
    physical_ids: list[int] | None
    env: dict[str, str]  # set in the launcher's os.environ before CUDA is touched and workers spawn
    messages: list[str]  # human lines to print once
    # Physical id -> the GPU's claim name (its UUID): the same GPU in a later snapshot, whose ids may have moved
    names: dict[int, str] = field(default_factory=dict)


def parse_gpus(spec: str) -> tuple[str, int | list[int] | GpuRange | None]:
    """Parse the one ``--gpus`` grammar: ``all | none | auto | auto:N | auto:MIN-MAX | 2,3``.

    Returns:
        ("all", None), ("none", None), ("auto", N, GpuRange(MIN, MAX) or None) or ("ids", [2, 3]).

    Raises:
        ConfigError: anything else, e.g. "two", "1,,2", "-1", "auto:0", "auto:3-2", "2,2".
    """
    text = spec.strip().lower()
    if text in ("all", "none", "auto"):
        return (text, None)
    elastic = parse_range(text)
    if isinstance(elastic, GpuRange):
        return ("auto", elastic)
    if elastic is not None:
        reason = elastic
    elif m := re.fullmatch(r"auto:(\d+)", text, re.ASCII):
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
        "e.g. --gpus 2,3, --gpus auto:2 or --gpus auto:2-4; run `ignite-mgpu devices` to list the GPU ids."
    )


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


def plan_gpus(
    spec: str | None,
    gpus: list[GpuInfo],
    environ: Mapping[str, str],
    nproc: int | None = None,
    unavailable: Mapping[int, str] | None = None,
) -> GpuPlan:
    """Turn ``--gpus`` plus a device snapshot into the physical GPUs to use and the env that selects them.

    Several GeForce RTX 40xx cards also get NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1 unless environ sets them.

    Args:
        spec: the ``--gpus`` value; None keeps CUDA_VISIBLE_DEVICES as it is. ``auto`` takes ``nproc`` GPUs when
            ``nproc`` is given, else 1; ``auto:N`` takes N. Both rank GPUs by idleness, then how well they are
            linked, free memory, load, id (``choice.py``).
        gpus: the snapshot from :func:`query_gpus`.
        environ: the launcher's environment (read only).
        nproc: ``--nproc``; with ``--gpus`` it must not exceed the selected GPUs (one GPU per process). Without
            ``--gpus`` it is not checked here: only the launcher knows whether the backend needs a GPU per process.
        unavailable: physical id -> why another job has it ("is claimed by alice (...)"): ``auto`` skips these,
            naming one of them is refused.

    Raises:
        GpusTaken: too few GPUs left by ``unavailable``, or one of them named.
        ConfigError: bad spec, unknown ids, no GPUs, too few GPUs, or a conflicting CUDA_VISIBLE_DEVICES.
    """
    messages: list[str] = []
    exported = environ.get("CUDA_VISIBLE_DEVICES")
    unavailable = unavailable or {}
    if spec is None:
        found = _as_exported(gpus, environ)
        _refuse_taken(
            "--gpus not given: the GPUs this job would use", used_ids(None, found, gpus, environ), gpus, unavailable
        )
        return found
    selected = _select(spec, gpus, nproc, messages, unavailable)
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
    _pci_order(environ, messages)
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": wanted}
    # A range that may grow is set for every GPU it may take (its workers inherit this process's environment).
    elastic = parse_range(spec.strip().lower())
    reach = gpus if isinstance(elastic, GpuRange) and elastic.high > 1 else [g for g in gpus if g.index in selected]
    env.update(_nccl_env(reach, environ, messages))
    names = {g.index: claim_name(g.uuid, g.pci_bus_id) for g in gpus if g.index in selected}
    return GpuPlan(selected, env, messages, names)


def used_ids(spec: str | None, plan: GpuPlan, gpus: list[GpuInfo], environ: Mapping[str, str]) -> list[int]:
    """The physical GPUs a job on ``plan`` uses, which it claims: the plan's; without ``--gpus``, those that
    CUDA_VISIBLE_DEVICES names, by id or by GPU-<uuid> (a prefix, as CUDA reads it; MIG instances are not mapped)."""
    if spec is not None or visible_ids(gpus, environ) is not None:
        return plan.physical_ids or []
    listed = [p.strip().lower() for p in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    named = [p for p in listed if p.startswith("gpu-")]
    return [g.index for g in gpus if g.uuid and any(g.uuid.lower().startswith(p) for p in named)]


def _as_exported(gpus: list[GpuInfo], environ: Mapping[str, str]) -> GpuPlan:
    """Without ``--gpus``: the GPUs CUDA_VISIBLE_DEVICES shows (every GPU when it is not set)."""
    messages: list[str] = []
    visible = visible_ids(gpus, environ)
    if not gpus or visible == []:
        return GpuPlan(None, {}, [])
    env: dict[str, str] = {}
    if visible is None:
        visible = [g.index for g in gpus]
        exported = environ.get("CUDA_VISIBLE_DEVICES")
        messages.append(f"CUDA_VISIBLE_DEVICES={exported} is kept as exported; it names GPUs by UUID.")
    else:
        # The ids were read as nvidia-smi's (claims, CPU binding): CUDA must count as it does, not fastest first.
        _pci_order(environ, messages)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.update(_nccl_env([g for g in gpus if g.index in visible], environ, messages))
    return GpuPlan(visible, env, messages)


def _pci_order(environ: Mapping[str, str], messages: list[str]) -> None:
    """The line saying that an exported CUDA_DEVICE_ORDER other than PCI_BUS_ID is overridden."""
    if environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID") != "PCI_BUS_ID":
        messages.append(
            f"Overriding CUDA_DEVICE_ORDER={environ['CUDA_DEVICE_ORDER']} with PCI_BUS_ID so GPU ids match nvidia-smi."
        )


def _select(
    spec: str, gpus: list[GpuInfo], nproc: int | None, messages: list[str], unavailable: Mapping[int, str]
) -> list[int] | None:
    """The physical ids ``spec`` selects (None: ``none``, the CPU); ``auto`` adds the line saying what it chose."""
    kind, arg = parse_gpus(spec)
    if kind == "none":
        return None
    if not gpus:
        raise ConfigError(
            f"--gpus {spec} requested but no NVIDIA GPU is visible on this machine (nvidia-smi found none); "
            "use --gpus none or leave it out to train on CPU with gloo."
        )
    if kind == "ids":
        assert isinstance(arg, list)
        known = [g.index for g in gpus]
        if missing := [i for i in arg if i not in known]:
            which = "GPU" if len(known) == 1 else "GPUs"
            raise ConfigError(
                f"--gpus {spec}: GPU {format_ids(missing)} requested; this machine has {which} {format_ids(known)} "
                "(physical ids as nvidia-smi shows them). Pick ids from `ignite-mgpu devices`."
            )
        _refuse_mig(spec, [g for g in gpus if g.index in arg])
        _refuse_taken(f"--gpus {spec}", arg, gpus, unavailable)
        return arg
    if kind == "all":
        _refuse_mig(spec, gpus)
        _refuse_taken(f"--gpus {spec}", [g.index for g in gpus], gpus, unavailable)
        return [g.index for g in gpus]
    if isinstance(arg, GpuRange):
        if nproc is not None:
            raise ConfigError(
                f"--nproc {nproc} with --gpus {spec}: the range decides the processes, one per GPU it gets (and "
                "fewer when it leaves out a failed GPU). Drop --nproc, or choose a fixed number with --gpus auto:N."
            )
        return _choose(spec, gpus, arg.count(gpus, unavailable), nproc, messages, unavailable)
    return _choose(spec, gpus, arg if isinstance(arg, int) else None, nproc, messages, unavailable)


def _choose(
    spec: str,
    gpus: list[GpuInfo],
    count: int | None,
    nproc: int | None,
    messages: list[str],
    unavailable: Mapping[int, str],
) -> list[int]:
    """``auto`` / ``auto:N`` / ``auto:MIN-MAX`` (``count`` from the range): of the cards not in MIG mode that no
    other job has, the idlest and best linked (``choice.choose``), and the lines naming the chosen and skipped."""
    # A MIG card's memory and load are the whole card's, not a slice's.
    whole = [g for g in gpus if not g.mig]
    count = count if count is not None else min(nproc or 1, len(whole))
    if count > len(whole):
        mig = [g.index for g in gpus if g.mig]
        has = f"{len(whole)} it can choose from ({format_ids(mig)} in MIG mode)" if mig else str(len(whole))
        raise ConfigError(
            f"--gpus {spec} asks for {count} GPUs but this machine has {has} "
            f"(GPUs {format_ids([g.index for g in gpus])}); ask for at most {len(whole)} or "
            f"{'name the ids of cards not in MIG mode' if mig else 'use --gpus all'}."
        )
    if count > len(left := [g for g in whole if g.index not in unavailable]):
        reasons = "; ".join(f"GPU {g.index} {unavailable[g.index]}" for g in whole if g.index in unavailable)
        ways = f"Ask for fewer (--gpus auto:{len(left)}), wait" if left else "Wait"
        raise GpusTaken(
            f"--gpus {spec} needs {plural(count, 'GPU')} that no other job has, but {len(left)} of the {len(whole)} "
            f"{'is' if len(left) == 1 else 'are'} left: "
            f"{reasons}. {ways} for them with --wait [SECONDS], or run beside the other jobs on purpose with --share."
        )
    chosen, said = choice.choose(spec, left, count, gpus)
    messages += said
    return chosen


def _refuse_taken(what: str, ids: list[int], gpus: list[GpuInfo], unavailable: Mapping[int, str]) -> None:
    """Naming a GPU that another job has is refused with who has it and the three ways out."""
    taken = [i for i in ids if i in unavailable]
    if not taken:
        return
    others = [g.index for g in gpus if g.index not in unavailable and g.index not in ids]
    hint = f" (GPU {format_ids(others)} {'is' if len(others) == 1 else 'are'} not taken)" if others else ""
    them = "it" if len(taken) == 1 else "them"
    raise GpusTaken(
        f"{what}: {'; '.join(f'GPU {i} {unavailable[i]}' for i in taken)}. Choose other GPUs with --gpus{hint}, "
        f"wait for {them} with --wait [SECONDS], or run beside the other job on purpose with --share."
    )


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
    """Disable NCCL P2P/IB for several RTX 40xx cards (those a job uses, or an elastic job may grow onto), unless
    the user exported the variable already."""
    if len(selected) < 2 or not any(_P2P_BROKEN.search(g.name) for g in selected):
        return {}
    env = {k: "1" for k in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE") if k not in environ}
    if env:
        messages.append(
            f"GeForce RTX 40xx GPUs for this job: NCCL peer-to-peer hangs on these cards, so setting "
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
