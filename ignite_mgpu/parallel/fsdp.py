"""FSDP2 (``torch.distributed.fsdp.fully_shard``): which blocks are sharded, the sharding itself, gradient sync on
accumulation steps, and evaluation that runs as many forwards on every rank. What a checkpoint holds of a sharded
model is ``checkpoint/state.py``'s."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 and 2.5: FSDP2 before torch.distributed.fsdp exported it (the same classes)
    from torch.distributed._composable.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

from ignite_mgpu.env import stop
from ignite_mgpu.errors import ConfigError

logger = logging.getLogger(__name__)
CONTAINERS = (nn.Sequential, nn.ModuleList)
# FSDP2 shards over the CPU (a gloo job) from PyTorch 2.6; before it, its streams and events are CUDA's.
CPU_FSDP_TORCH = (2, 6)


def runs_on_cpu() -> bool:
    """Whether this PyTorch's FSDP2 runs on the CPU (``CPU_FSDP_TORCH``)."""
    major, minor = torch.__version__.split(".")[:2]
    return (int(major), int(minor)) >= CPU_FSDP_TORCH


def check_device(device_type: str, world_size: int) -> None:
    """ConfigError when FSDP would shard over the CPU with a PyTorch whose FSDP2 needs CUDA (one process has
    nothing to shard: its model is only moved to its device)."""
    if device_type == "cpu" and world_size > 1 and not runs_on_cpu():
        version = ".".join(map(str, CPU_FSDP_TORCH))
        raise ConfigError(
            f"strategy=fsdp with {world_size} processes on the CPU needs PyTorch {version} or newer: FSDP2 in "
            f"PyTorch {torch.__version__} runs only on CUDA GPUs (its streams are CUDA's). Upgrade torch "
            f"(pip install -U 'torch>={version}'), train on GPUs, or use strategy=ddp."
        )


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def default_blocks(model: nn.Module) -> list[str]:
    """The block class of the default rule: breadth-first from the model (itself included), the first
    ``nn.Sequential`` / ``nn.ModuleList`` with at least two parameter-holding children of one class gives it (at the
    same depth, the class holding the most parameters). A ResNet gives ``BasicBlock``/``Bottleneck`` (its
    ``layer1..4``), a transformer its layer class (``layers``/``h``), an MLP built as one Sequential ``Linear``. No
    such container: no blocks, only the root is sharded."""
    level = [model]
    while level:
        found: Counter[type] = Counter()
        for container in level:
            if isinstance(container, CONTAINERS):
                children = [c for c in container.children() if _holds_parameters(c)]
                repeated = Counter(type(c) for c in children)
                for c in children:
                    if repeated[type(c)] >= 2:
                        found[type(c)] += sum(p.numel() for p in c.parameters())
        if found:
            return [found.most_common(1)[0][0].__name__]
        level = [child for m in level for child in m.children()]
    return []


def class_names(model: nn.Module) -> set[str]:
    """Every module class name in ``model``; a lazy module also counts as the class it becomes (LazyLinear: Linear)."""
    names = set()
    for m in model.modules():
        names.add(type(m).__name__)
        becomes = getattr(m, "cls_to_become", None)
        if isinstance(becomes, type):
            names.add(becomes.__name__)
    return names


def check_blocks(model: nn.Module, names: Sequence[str], model_name: str | None = None) -> None:
    """ConfigError when ``model.fsdp_blocks`` names a class that the model does not contain."""
    have = class_names(model)
    missing = [n for n in names if n not in have]
    if missing:
        with_params = sorted({type(m).__name__ for m in model.modules() if _holds_parameters(m)})
        where = f"model.name={model_name}" if model_name else "the model"
        raise ConfigError(
            f"model.fsdp_blocks names {', '.join(missing)}, but {where} contains no module of that class (its "
            f"classes with parameters: {', '.join(with_params)}). Name the class of the model's repeated blocks "
            "(e.g. BasicBlock for resnet18), or leave model.fsdp_blocks out for the default rule."
        )


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """``train.precision`` as FSDP's policy: bf16/fp16 parameters in forward and backward, gradients reduced and kept
    in fp32 (the sharded parameters and the optimizer stay fp32); fp32: no casting."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_model(
    model: nn.Module,
    blocks: Sequence[str] | None = None,
    precision: str = "fp32",
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` on every block (innermost first), then on the model: in place, the module keeps its class
    (as ``FSDP<Class>``), its parameter names and its attributes; its parameters become sharded DTensors.

    Blocks are the modules whose class is named in ``blocks`` (None: ``default_blocks``). Each block's parameters
    are gathered for its forward and freed after it (``reshard_after_forward``); the root's stay gathered from
    forward to backward, which begins with them (FSDP's own choice for the root). fully_shard moves each unit to
    this process's device as it shards it, so the whole model is never on one GPU. Create the optimizer after this.
    One process has nothing to shard: the model is only moved to its device, as with DDP.
    """
    import ignite.distributed as idist

    names = list(blocks) if blocks is not None else default_blocks(model)
    if blocks is not None:
        check_blocks(model, names)
    if idist.get_world_size() == 1:  # the launcher says so once
        return model.to(idist.device())
    check_device(idist.device().type, idist.get_world_size())  # the pre-flight's check, for launch()'s own code
    common: dict[str, Any] = {"mp_policy": mixed_precision(precision)}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
        common["mesh"] = offload_mesh()
    units = fsdp_units(model, names)
    shard_units(model, units, reshard_after_forward, **common)
    logger.info(
        "fsdp: %d block(s) of %s sharded over %d processes, then the root (%s)",
        len(units),
        ", ".join(names) or "no class",
        idist.get_world_size(),
        "parameters in " + str(common["mp_policy"].param_dtype or torch.float32).replace("torch.", ""),
    )
    return model


def fsdp_units(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The modules whose class is named in ``names``, outermost first (as ``modules()`` lists them); not the root."""
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def shard_units(model: nn.Module, units: list[nn.Module], reshard_after_forward: bool, **common: Any) -> None:
    """``fully_shard`` on each unit, innermost first (children before their parents), then on the root, whose
    parameters stay gathered from forward to backward; ``common`` goes to every call (mesh, precision, offload)."""
    for unit in reversed(units):
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **common)
    fully_shard(model, **common)


def offload_backend(backend: str) -> str | None:
    """The backends of the group that FSDP's CPU offload shards over, given the job's (None: the job's own group).
    Offloaded gradients are CPU DTensors: clipping's norm and the GradScaler's found-inf check all-reduce them over
    the mesh's group, which NCCL alone cannot do (torchtitan initialises "cuda:nccl,cpu:gloo" when offloading)."""
    return "cuda:nccl,cpu:gloo" if backend == "nccl" else None


def offload_mesh() -> Any:
    """The device mesh of FSDP's CPU offload: every rank, over a group with a CPU backend (``offload_backend``);
    None keeps fully_shard's default mesh (a gloo job's group has one already)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    backend = offload_backend(str(dist.get_backend()))
    if backend is None:
        return None
    # One group per job's group: each new one would hold another NCCL communicator (GPU memory) for good.
    world = id(dist.group.WORLD)
    if world not in _OFFLOAD_MESHES:
        group = cast(dist.ProcessGroup, dist.new_group(backend=backend, timeout=stop.group_timeout()))
        _OFFLOAD_MESHES[world] = DeviceMesh.from_group(group, "cuda")
    return _OFFLOAD_MESHES[world]


_OFFLOAD_MESHES: dict[int, Any] = {}


def find_fsdp(model: nn.Module) -> FSDPModule | None:
    """The root FSDP module of a prepared model (also inside torch.compile), or None."""
    for candidate in (model, getattr(model, "_orig_mod", None)):
        if isinstance(candidate, FSDPModule):
            return candidate
    return None


@contextlib.contextmanager
def _without_gradient_sync(module: FSDPModule) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def no_sync_of(module: FSDPModule) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """FSDP2's counterpart of DDP's ``no_sync``: inside it, backward accumulates unsharded gradients locally and
    reduce-scatters nothing; the micro-batch after it (synced again) reduce-scatters the sum."""
    return lambda: _without_gradient_sync(module)
