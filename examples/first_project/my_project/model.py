"""The model factory (model.name: my_project.model:build): a small 1-D convolutional classifier."""

from __future__ import annotations

from torch import nn


def build(num_classes: int, width: int = 16) -> nn.Module:
    """num_classes comes from model.num_classes; width from model.args."""
    return nn.Sequential(
        nn.Conv1d(1, width, kernel_size=7, padding=3),
        nn.ReLU(),
        nn.Conv1d(width, width, kernel_size=7, padding=3),
        nn.ReLU(),
        nn.AdaptiveMaxPool1d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )
