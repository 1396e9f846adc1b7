"""What a checkpoint holds of the model and the optimizer: the unwrapped module and the optimizer as they are, or
for a model sharded by FSDP the full state gathered onto rank 0 (``checkpoint.format=full``: the same plain files as
DDP's) or each rank's shards (``checkpoint.format=sharded``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ignite_mgpu.parallel.fsdp import find_fsdp
from ignite_mgpu.parallel.strategy import unwrap

# Gathered tensor by tensor onto rank 0's CPU.
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


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
