"""Optimizer, schedule, parameter-group and loss factories as a user would write them, well and badly."""

from __future__ import annotations

import torch
from torch import nn


def adam_with_trust(params, lr, weight_decay, trust: float = 1.0):
    """An optimizer from 'another package': called with the groups, lr, weight_decay and optim.args."""
    opt = torch.optim.Adam(params, lr=lr * trust, weight_decay=weight_decay)
    opt.trust = trust  # what the test reads back
    return opt


def no_weight_decay(params, lr):
    return torch.optim.SGD(params, lr=lr)


def not_an_optimizer(params, lr, weight_decay):
    return [params, lr, weight_decay]


def halving(optimizer, total_steps, every: int = 2):
    """A schedule of the user's: told the run's length (total_steps), stepped once per optimizer step."""
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=every, gamma=0.5)
    schedule.total = total_steps
    return schedule


def plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def heads_faster(model: nn.Module):
    """Two groups: the last layer at ten times the learning rate, without weight decay."""
    head = list(model.children())[-1]
    body = [p for m in list(model.children())[:-1] for p in m.parameters()]
    return [{"params": body}, {"params": list(head.parameters()), "lr": 0.5, "weight_decay": 0.0}]


def only_parameters(model: nn.Module):
    return (p for p in model.parameters())  # a generator: one group


def foreign(model: nn.Module):
    return [{"params": [nn.Parameter(torch.zeros(2))]}]


def twice(model: nn.Module):
    params = list(model.parameters())
    return [{"params": params}, {"params": params[:1]}]


def first_layer_only(model: nn.Module):
    return [{"params": list(model.children())[0].parameters()}]


def focal(gamma: float = 2.0):
    """A loss factory with an argument (train.loss_args.gamma)."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = nn.functional.cross_entropy(logits, targets, reduction="none")
        return ((1 - torch.exp(-ce)) ** gamma * ce).mean()

    loss.gamma = gamma
    return loss
