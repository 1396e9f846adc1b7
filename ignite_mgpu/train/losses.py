"""``train.loss`` with ``train.loss_args``: cross-entropy (label smoothing, class weights, an ignored index), the
model's own loss, or a factory of the user's; checked in the parent before spawning (the pre-flight imports this
module: ignite is imported only when a weighted loss is placed on the default device)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ignite_mgpu.config.checks import BUILTIN_LOSSES, check_loss_args
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import plugins


def create_loss(
    name: str, loss_args: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None
) -> Callable[..., torch.Tensor] | None:
    """``train.loss``: "cross_entropy" (``nn.CrossEntropyLoss(**loss_args)``, ``weight`` a list of class weights,
    placed on ``device``, by default ``idist.device()``), "model" (None: the model computes its own), or a factory of
    the user's ("package.module:factory") called with ``loss_args``, returning a loss function
    ``(predictions, targets) -> loss``."""
    args = dict(loss_args or {})
    check_loss(name, args)
    if name == "cross_entropy":
        if "weight" in args:
            if device is None:
                import ignite.distributed as idist

                device = idist.device()
            args["weight"] = torch.tensor(args["weight"], dtype=torch.float32, device=device)
        return nn.CrossEntropyLoss(**args)
    if name == "model":
        return None
    loss = plugins.call(plugins.resolve(name, "train.loss"), args, name, "train.loss")
    if not callable(loss):
        raise ConfigError(f"train.loss={name} returned a {type(loss).__name__}; a loss factory returns a callable.")
    return loss


def check_loss(name: str, loss_args: Mapping[str, Any]) -> None:
    """ConfigError unless ``train.loss_args`` fits ``train.loss``: a built-in loss's arguments (``check_loss_args``,
    torch-free: the launching process checks them with the config), the keyword arguments a factory takes (whose
    module is imported to check)."""
    if name in BUILTIN_LOSSES:
        check_loss_args(name, loss_args)
        return
    fn = plugins.resolve(name, "train.loss")
    plugins.check_arguments(fn, loss_args, f"train.loss={name}", "train.loss_args")
