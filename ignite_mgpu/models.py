"""Models by name: the built-in small CNN, any torchvision.models name, or a "package.module:factory" import path."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ignite_mgpu.errors import ConfigError

if TYPE_CHECKING:
    from ignite_mgpu.config import ModelConfig


class SimpleCNN(nn.Module):
    """A small CNN for 32x32 (or larger) images: fast on a CPU, enough to learn the synthetic data."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(32 * POOLED * POOLED, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(pool_to(self.features(x), POOLED), 1))


POOLED = 4  # SimpleCNN pools its features to 4x4, whatever the image size


def pool_to(x: torch.Tensor, size: int) -> torch.Tensor:
    """``adaptive_avg_pool2d(x, size)``, as a plain average pool when the sides divide by ``size``: the same numbers,
    and unlike adaptive pooling its CUDA backward is deterministic (``train.deterministic`` runs it)."""
    h, w = x.shape[-2:]
    if h % size == 0 and w % size == 0:
        return F.avg_pool2d(x, (h // size, w // size))
    return F.adaptive_avg_pool2d(x, size)


def _mlp(num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(128), nn.ReLU(inplace=True), nn.Linear(128, num_classes))


BUILTIN = {"simple_cnn": SimpleCNN, "mlp": _mlp}


def check_model_name(name: str) -> None:
    """Raise ConfigError unless ``name`` resolves to a model constructor (runs in the parent, before spawning)."""
    _resolve(name)


def _resolve(name: str) -> Callable[..., nn.Module]:
    """The constructor (taking ``num_classes=``) that ``name`` names."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(
                f"model.name={name}: cannot import '{attr}' from module '{module_name}' ({err}). "
                "Use 'package.module:factory' where factory(num_classes=...) returns an nn.Module."
            ) from None
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name in available:
        return lambda num_classes: torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    import difflib

    close = difflib.get_close_matches(name, list(BUILTIN) + available, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"model.name={name} is not a known model.{hint} Use a built-in name ({', '.join(BUILTIN)}), a "
        "torchvision.models name such as resnet18, or 'package.module:factory'."
    )


def create_model(cfg: ModelConfig, example: torch.Tensor | None = None) -> nn.Module:
    """Build the model (randomly initialised, no downloaded weights) on the CPU.

    ``example`` (one input batch) materialises lazy layers such as ``nn.LazyLinear``: DDP refuses
    uninitialised parameters.
    """
    model = _resolve(cfg.name)(num_classes=cfg.num_classes)
    if example is not None and any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        with torch.no_grad():
            model(example)
    return model
