"""Model, loss and optimizer factories that fail, for the checks before spawning (tests/hostile/test_factories.py)."""

import torch
from torch import nn


def model_raises(num_classes: int = 10) -> nn.Module:
    raise RuntimeError("the model factory broke")


def model_wrong(num_classes: int = 10) -> str:
    return "not a model"


def model_reads_values(num_classes: int = 10) -> nn.Module:
    """Reads a tensor's value while building: impossible on the meta device."""
    model = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))
    if torch.zeros(1).item() != 0.0:
        raise AssertionError
    return model


def loss_raises() -> nn.Module:
    raise ValueError("the loss factory broke")


def optimizer_raises(params, lr, weight_decay):
    raise TypeError("the optimizer factory broke")


def optimizer_wrong(params, lr, weight_decay):
    return [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]


def model_frozen(num_classes: int = 10) -> nn.Module:
    """Every parameter frozen: the optimizer would train nothing."""
    return nn.Linear(4, num_classes).requires_grad_(False)
