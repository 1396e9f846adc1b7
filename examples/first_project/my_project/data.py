"""The dataset factory (data.name: my_project.data:build): noisy waves, labelled by their frequency."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset


class Waves(Dataset):
    """``size`` signals of ``length`` samples; the label is which of ``classes`` frequencies each one has."""

    def __init__(self, size: int, length: int, classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (size,), generator=g)
        t = torch.arange(length) / length
        phase = torch.rand(size, 1, generator=g) * 2 * math.pi
        freq = (self.labels + 1).unsqueeze(1).float()
        noise = 0.3 * torch.randn(size, length, generator=g)
        self.signals = (torch.sin(2 * math.pi * freq * t + phase) + noise).unsqueeze(1)  # (size, 1 channel, length)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.signals[index], self.labels[index]


def build(length: int = 64, classes: int = 4, train_size: int = 2000, val_size: int = 500) -> tuple[Waves, Waves]:
    """Returns (train, val); data.args reach these keyword arguments."""
    return Waves(train_size, length, classes, seed=1), Waves(val_size, length, classes, seed=2)
