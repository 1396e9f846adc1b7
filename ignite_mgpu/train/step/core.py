"""What a training step is made of (``Step``: built once by ``create_trainer``, read by both steps, ``trainer.py``'s
and ``micro_step.py``'s), and the end of an accumulation window that both share (``optimizer_step``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ignite_mgpu.train.data.batches import Batch
from ignite_mgpu.train.step.micro_batch import MicroBatching
from ignite_mgpu.train.step.timing import StepTimes


class Shares:
    """How much each batch's mean loss of this rank counts when the ranks' shares of the global batch are uneven
    (``GlobalBatchSampler.weights()``: batch k of the epoch counts ``weights[k]``); None while they are even, the
    step then multiplies nothing. ``largest``: the most samples any rank holds of batch k
    (``GlobalBatchSampler.largest()``), which the step in parts reads under FSDP and SyncBatchNorm; None for a loader
    of the user's. Set at every epoch's start from the loader the trainer runs."""

    def __init__(self) -> None:
        self.weights: list[float] | None = None
        self.largest: list[int] | None = None

    def weight(self, iteration: int) -> float:
        """The weight of ``iteration`` (1-based, counted over the run), with uneven shares."""
        assert self.weights is not None
        return self.weights[(iteration - 1) % len(self.weights)]

    def largest_share(self, iteration: int) -> int:
        """The most samples any rank holds of ``iteration``'s batch."""
        assert self.largest is not None
        return self.largest[(iteration - 1) % len(self.largest)]


@dataclass(frozen=True, eq=False)
class Step:
    """The parts of ``create_trainer``'s training step, chosen once (``trainer.step``): the steps read them when they
    are built, never per iteration. The parts stay the same; ``micro_batching``'s size changes under ``auto``, and
    ``shares``' weights are set at every epoch's start (read per iteration only while the shares are uneven)."""

    model: nn.Module  # as prepare_model placed it: DDP, DataParallel, FSDP or plain
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor] | None  # the user's; None: the model computes its own loss
    # One batch's loss: loss_fn over the model's output (or the model's own), under autocast for bf16/fp16.
    compute_loss: Callable[[Batch], torch.Tensor]
    precision: str  # "fp32", "bf16" or "fp16" (compute_loss's autocast; the scaler's)
    # fp16's loss scaling, disabled for the others; checkpoints save and restore it as "scaler".
    scaler: torch.amp.GradScaler
    device: torch.device  # where the batches go (a CPU job's stay where the loader put them)
    non_blocking: bool  # batches copied to the device asynchronously
    grad_accum_steps: int  # iterations per optimizer step
    clip_grad_norm: float | None  # the bound on the gradients' global norm; None: no clipping
    lr_scheduler: LRScheduler | None  # stepped once per optimizer step taken
    # The trainable parameters: clipped, and under micro_batch=auto set aside while a trial may fail.
    parameters: tuple[nn.Parameter, ...] = field(repr=False)
    # The strategy's gradient sync turned off (parallel.strategy.no_sync), entered on accumulation steps.
    no_sync: Callable[[], AbstractContextManager[None]]
    # train.micro_batch's part size (micro_step.py runs the step); None: whole batches (trainer.py's step).
    micro_batching: MicroBatching | None
    # Where this rank's step time goes (compute, the wait for the gradient sync, the optimizer), summed per epoch.
    times: StepTimes = field(repr=False)
    # Uneven shares of the global batch (more processes than divide it): each rank's loss weight per batch.
    shares: Shares = field(default_factory=Shares, repr=False)


def optimizer_step(step: Step) -> Callable[[], None]:
    """The end of an accumulation window, for both steps: unscale, clip the true gradients (the global norm), step,
    zero the gradients, advance the schedule. GradScaler skips the optimizer step when the scaled gradients
    overflowed (normal in fp16's first steps): the schedule then does not advance either, which a post-step hook
    tells without a host-device sync."""
    optimizer, scaler, parameters = step.optimizer, step.scaler, step.parameters
    clip_grad_norm, lr_scheduler = step.clip_grad_norm, step.lr_scheduler
    fp16, stepped = scaler.is_enabled(), [True]
    if fp16 and lr_scheduler is not None:
        optimizer.register_step_post_hook(lambda *_: stepped.__setitem__(0, True))

    def finish() -> None:
        if clip_grad_norm is not None:
            if fp16:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad_norm)
        if fp16:
            stepped[0] = False
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if lr_scheduler is not None and stepped[0]:
            lr_scheduler.step()

    return finish
