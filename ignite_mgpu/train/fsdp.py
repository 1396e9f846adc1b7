"""FSDP2 (``torch.distributed.fsdp.fully_shard``): which blocks are sharded, the sharding itself, gradient sync on
accumulation steps, evaluation that runs as many forwards on every rank, and the model and optimizer state as full
(gathered on rank 0) or sharded state dicts."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from ignite_mgpu.errors import ConfigError

if TYPE_CHECKING:
    from ignite.engine import Engine

logger = logging.getLogger(__name__)
CONTAINERS = (nn.Sequential, nn.ModuleList)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered tensor by tensor onto rank 0's CPU


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
    common: dict[str, Any] = {"mp_policy": mixed_precision(precision)}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    units = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    for unit in reversed(units):  # modules() is outermost first: children must be sharded before their parents
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **common)
    fully_shard(model, **common)
    logger.info(
        "fsdp: %d block(s) of %s sharded over %d processes, then the root (%s)",
        len(units),
        ", ".join(names) or "no class",
        idist.get_world_size(),
        "parameters in " + str(common["mp_policy"].param_dtype or torch.float32).replace("torch.", ""),
    )
    return model


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


# ------------------------------------------------------------------------------------------------- evaluation


def attach_even_forwards(evaluator: Engine, step: Callable[[Engine, Any], Any]) -> None:
    """Make every rank run as many forwards as the rank with the most validation batches.

    Each FSDP forward all-gathers parameters, a collective, and the validation shards are uneven (every sample is
    counted once), so a rank with fewer batches would leave the others waiting forever. The ranks agree on the
    most batches when the evaluation starts (a collective then, while every rank is there); after its own batches
    a rank repeats ``step`` on its last batch as often as it is short. The outputs are dropped, so the metrics
    never see them. Attach it before the metrics: their EPOCH_COMPLETED handlers all-reduce, after these forwards.
    """
    import ignite.distributed as idist
    from ignite.engine import Events

    start, most = [0], [0]

    def started(engine: Engine) -> None:
        start[0] = engine.state.iteration
        mine = torch.tensor(engine.state.epoch_length or 0, device=idist.device())
        most[0] = int(idist.all_reduce(mine, op="MAX"))

    def pad(engine: Engine) -> None:
        for _ in range(most[0] - (engine.state.iteration - start[0])):
            step(engine, engine.state.batch)

    evaluator.add_event_handler(Events.EPOCH_STARTED, started)
    evaluator.add_event_handler(Events.EPOCH_COMPLETED, pad)


# ------------------------------------------------------------------------------------------------- full state dicts


class FullModelState:
    """A sharded model's ``state_dict`` in checkpoints: the full, plain state dict gathered onto rank 0's CPU (empty
    on the other ranks, which do not write), as DDP's; loading takes a full state dict on every rank and shards it.
    Both are collectives: every rank calls them, as ignite's Checkpoint does."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module, options=FULL)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # set_model_state_dict replaces the values of the dict it gets by shards: give it a copy.
        set_model_state_dict(self.module, dict(state_dict), options=StateDictOptions(full_state_dict=True))


class FullOptimizerState:
    """A sharded model's optimizer state in checkpoints: gathered onto rank 0 and keyed as ``optimizer.state_dict()``
    keys it (parameter indices, not names), so DDP and FSDP checkpoints are the same file and resume each other."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def _names(self) -> list[str]:
        name_of = {id(p): name for name, p in self.module.named_parameters()}
        return [name_of[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = get_optimizer_state_dict(self.module, self.optimizer, options=FULL)
        if not state:  # not rank 0: nothing to write
            return {}
        index = {name: i for i, name in enumerate(self._names())}
        return {
            "state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        names = self._names()
        named: Any = {
            "state": {names[int(i)]: value for i, value in state_dict["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state_dict["param_groups"]],
        }
        set_optimizer_state_dict(self.module, self.optimizer, named, options=StateDictOptions(full_state_dict=True))


def checkpoint_objects(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """What checkpoints save for the model and the optimizer: the unwrapped module and the optimizer, or for a
    sharded model the full-state adapters above (best_model_*.pt and checkpoint_*.pt stay plain files)."""
    fsdp = find_fsdp(model)
    if fsdp is None:
        from ignite_mgpu.train.strategy import unwrap

        return unwrap(model), optimizer
    module = cast(nn.Module, fsdp)  # an FSDPModule is the user's module, changed in place
    return FullModelState(module), FullOptimizerState(module, optimizer)


def module_and_optimizer(model_obj: Any, optimizer_obj: Any) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The live module and optimizer (None: none given) behind ``checkpoint_objects``' pair."""
    module = model_obj.module if isinstance(model_obj, FullModelState) else model_obj
    optimizer = optimizer_obj.optimizer if isinstance(optimizer_obj, FullOptimizerState) else optimizer_obj
    return module, optimizer


def sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model and optimizer as ``torch.distributed.checkpoint`` saves and loads them: this rank's shards
    (DTensors) for a sharded model, plain tensors otherwise; optimizer state keyed by parameter name."""
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer)
    return state


def load_sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Put a ``sharded_state`` dict that ``dcp.load`` filled back into the module and the optimizer."""
    set_model_state_dict(module, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, state["optimizer"])
