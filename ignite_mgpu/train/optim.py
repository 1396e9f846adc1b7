"""The optimizer and the learning-rate schedule of the default job (``optim:`` in the config)."""

from __future__ import annotations

import functools
import math

import ignite.distributed as idist
import torch
from torch import nn


def create_optimizer(
    model: nn.Module, name: str, lr: float, momentum: float, weight_decay: float, nesterov: bool = True
) -> torch.optim.Optimizer:
    """SGD (Nesterov momentum when ``nesterov`` and ``momentum > 0``) or AdamW over the trainable parameters,
    wrapped by ``idist.auto_optim``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov and momentum > 0
        )
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    else:
        raise ValueError(f"optimizer name={name!r}: use 'sgd' or 'adamw'.")
    return idist.auto_optim(opt)


def _warmup_cosine(step: int, warmup: int, total: int, cosine: bool) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if not cosine:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def create_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, cosine: bool = True
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay (or constant), stepped once per optimizer step by the trainer."""
    fn = functools.partial(_warmup_cosine, warmup=warmup_steps, total=total_steps, cosine=cosine)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
