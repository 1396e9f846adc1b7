"""``train.loss`` with ``train.loss_args``: cross-entropy (label smoothing, class weights, an ignored index), the
model's own loss, or a factory of the user's; checked in the parent before spawning (the pre-flight imports this
module: ignite is imported only when a weighted loss is placed on the default device)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import plugins

CROSS_ENTROPY_ARGS = ("label_smoothing", "weight", "ignore_index")  # reduction stays "mean": the trainer averages


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
    """ConfigError unless ``train.loss_args`` fits ``train.loss``: cross-entropy's three arguments with usable values,
    nothing for "model", the keyword arguments a factory takes (whose module is imported to check)."""
    if name == "model":
        if loss_args:
            raise ConfigError(
                "train.loss_args is for a loss function, but train.loss=model: the model computes its loss."
            )
        return
    if name != "cross_entropy":
        fn = plugins.resolve(name, "train.loss")
        plugins.check_arguments(fn, loss_args, f"train.loss={name}", "train.loss_args")
        return
    unknown = sorted(set(loss_args) - set(CROSS_ENTROPY_ARGS))
    if unknown:
        raise ConfigError(
            f"train.loss_args gives {', '.join(unknown)}, which train.loss=cross_entropy does not take (it takes "
            f"{', '.join(CROSS_ENTROPY_ARGS)}; the reduction is the batch mean, which the trainer needs). Remove it, "
            "or write a loss factory."
        )
    smoothing = loss_args.get("label_smoothing", 0.0)
    if not isinstance(smoothing, (int, float)) or isinstance(smoothing, bool) or not 0 <= smoothing <= 1:
        raise ConfigError(f"train.loss_args.label_smoothing={smoothing!r}: use a number from 0 to 1, e.g. 0.1.")
    weight = loss_args.get("weight", [1.0])
    numbers = isinstance(weight, (list, tuple)) and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0 for w in weight
    )
    if not numbers or not weight:
        raise ConfigError(
            f"train.loss_args.weight={weight!r}: give one weight >= 0 per class, as a list such as [1.0, 2.0, 0.5]."
        )
    index = loss_args.get("ignore_index", -100)
    if not isinstance(index, int) or isinstance(index, bool):
        raise ConfigError(f"train.loss_args.ignore_index={index!r}: use the integer target to ignore, e.g. -100.")
