"""The model and data of the DataParallel tutorial (docs/tutorials/from-dataparallel.md), shared by its three
scripts: before.py (nn.DataParallel), after.py (the Python path) and train.yaml (the CLI path, through the factories
below: ``model.name: project:build_model``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Net(nn.Module):
    """A small classifier with BatchNorm that computes its own loss, as many DataParallel scripts do:
    ``forward(x, y)`` returns the batch's cross-entropy, ``forward(x)`` the class scores."""

    def __init__(self, features: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        scores = self.body(x)
        return scores if y is None else nn.functional.cross_entropy(scores, y)


def make_split(n: int, seed: int, features: int = 16, classes: int = 4) -> TensorDataset:
    """Gaussian clusters, one per class: learnable in a few epochs. The same seed gives the same data anywhere."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=torch.Generator().manual_seed(1234)) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, features, generator=g), y)


def build_model(num_classes: int, features: int = 16) -> nn.Module:
    """model.name: project:build_model (num_classes comes from model.num_classes)."""
    return Net(features, num_classes)


def build_data(train_size: int = 2048, val_size: int = 500) -> tuple[TensorDataset, TensorDataset]:
    """data.name: project:build_data: the training and validation datasets."""
    return make_split(train_size, seed=1), make_split(val_size, seed=2)
