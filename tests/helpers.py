"""Small models and loaders shared by the in-process tests (one process, CPU, a few milliseconds each)."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def data(n=32, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(6, 3)


class LossModel(nn.Module):
    """A model whose forward returns its own loss, as in many notebooks."""

    def __init__(self):
        super().__init__()
        self.net = linear()

    def forward(self, x, y=None):
        logits = self.net(x)
        return logits if y is None else nn.functional.cross_entropy(logits, y)


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
