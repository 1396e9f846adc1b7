"""timm models by name, random-initialised (pretrained=False: nothing is downloaded; docs/how-to/timm.md).
``model.name: examples.timm_models.models:create`` with ``model.args: {name: resnet18, ...}``."""

from __future__ import annotations

import timm
from torch import nn


def create(name: str, num_classes: int, **kwargs: object) -> nn.Module:
    """Any ``timm.list_models()`` name; ``kwargs`` reach its constructor (img_size, depth, drop_rate, ...)."""
    return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
