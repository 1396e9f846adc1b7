"""The optimizer's parameter groups: one group of the trainable parameters (the default), biases and normalisation
layers without weight decay (``optim.no_decay_norm_and_bias``), or the groups of the user's factory
(``optim.param_groups``). Built from the prepared model, whose parameters are the ones the optimizer must update
(DTensors after FSDP2's ``fully_shard``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import plugins

logger = logging.getLogger("ignite_mgpu")
# torch's normalisation layers: BatchNorm*, SyncBatchNorm and InstanceNorm* share _NormBase (private: no public base;
# tests/test_private_apis.py guards it). Subclasses count (timm's LayerNorm2d, FSDP2's in-place FSDPLayerNorm);
# Hugging Face's own RMSNorm classes hold 1-d weights, which count too.
NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
KEY = "optim.param_groups"


def parameter_groups(
    model: nn.Module, no_decay_norm_and_bias: bool = False, factory: str | None = None
) -> list[nn.Parameter] | list[dict[str, Any]]:
    """What the optimizer is given: the trainable parameters of ``model`` (one group), two groups (the second with
    ``weight_decay=0``: every parameter of a normalisation layer and every parameter of at most one dimension, the
    biases among them), or the groups that ``factory(model)`` returns, checked against the model's parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if factory is not None:
        return _factory_groups(model, factory, trainable)
    if not no_decay_norm_and_bias:
        return trainable
    exempt = {id(p) for m in model.modules() if isinstance(m, NORMS) for p in m.parameters(recurse=False)}
    # A DTensor's ndim is the full tensor's.
    no_decay = [p for p in trainable if p.ndim <= 1 or id(p) in exempt]
    skip = {id(p) for p in no_decay}
    decay = [p for p in trainable if id(p) not in skip]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _factory_groups(model: nn.Module, factory: str, trainable: list[nn.Parameter]) -> list[dict[str, Any]]:
    """``factory(model)``, the user's own module (unwrapped from DDP / DataParallel / torch.compile), as a list of
    groups; every parameter in it one of the model's, in one group only."""
    # Here: the pre-flight imports this module, and ignite stays out of it.
    import ignite.distributed as idist

    from ignite_mgpu.parallel.strategy import unwrap

    fn = plugins.resolve(factory, KEY)
    returned = plugins.call(lambda: fn(unwrap(model)), {}, factory, KEY)
    groups = _as_groups(returned, factory)
    owned = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    for i, group in enumerate(groups):
        for p in group["params"]:
            if id(p) not in owned:
                raise ConfigError(
                    f"{KEY}={factory}: group {i} holds a tensor that is not a parameter of the model it was given "
                    "(under FSDP the parameters are the sharded ones: take them from that model, after wrapping)."
                )
            if id(p) in seen:
                raise ConfigError(f"{KEY}={factory}: a parameter is in two groups (again in group {i}); list it once.")
            seen.add(id(p))
    left = [p for p in trainable if id(p) not in seen]
    if left and idist.get_rank() == 0:
        logger.warning("%s=%s leaves %d trainable parameters out of every group: not trained", KEY, factory, len(left))
    return groups


def _as_groups(returned: Any, factory: str) -> list[dict[str, Any]]:
    """The factory's answer as torch's form: a list of dicts, each with a list under "params"."""
    if isinstance(returned, torch.Tensor) or not isinstance(returned, Iterable):
        raise ConfigError(
            f"{KEY}={factory} returned a {type(returned).__name__}; a parameter-group factory returns a list of dicts "
            "with 'params' (and per-group settings such as 'weight_decay' or 'lr'), or a list of parameters."
        )
    items = list(returned)
    if items and all(isinstance(p, torch.Tensor) for p in items):
        items = [{"params": items}]
    groups = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or "params" not in item:
            raise ConfigError(
                f"{KEY}={factory}: item {i} of its answer is a {type(item).__name__}, not a dict with 'params'; "
                "return a list of dicts such as [{'params': [...], 'weight_decay': 0.0}, ...]."
            )
        params = item["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        groups.append({**item, "params": params})
    if not any(g["params"] for g in groups):
        raise ConfigError(f"{KEY}={factory} returned no parameters: the optimizer would train nothing.")
    return groups
