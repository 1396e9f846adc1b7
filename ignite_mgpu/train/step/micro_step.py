"""The training step of ``create_trainer(micro_batch=...)``: each part's forward and backward, weighted by its
samples, one gradient sync per iteration, as many parts on every rank where every forward is a collective (FSDP,
SyncBatchNorm: zero-weight parts pad a smaller share), and under ``auto`` the same batch retried with smaller parts
after an out-of-memory error that every rank agreed on. ``trainer.py``'s own step runs when micro_batch is None."""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Engine
from torch import nn

from ignite_mgpu.env import stop
from ignite_mgpu.parallel.fsdp import FSDPModule, find_fsdp
from ignite_mgpu.parallel.strategy import find_ddp, unwrap
from ignite_mgpu.train.data import batches
from ignite_mgpu.train.data.batches import Batch
from ignite_mgpu.train.step.core import Shares, Step, optimizer_step
from ignite_mgpu.train.step.guard import accumulation_window
from ignite_mgpu.train.step.micro_batch import (
    BATCH_NORMS,
    SETTLE_ITERATIONS,
    MicroBatching,
    MicroBatchTooLarge,
    counted_items,
    is_out_of_memory,
    next_size,
    padded,
    split_batch,
)


class _Retry(Exception):
    """Another rank ran out of memory: every rank retries the batch with ``size`` samples per part."""

    def __init__(self, size: int) -> None:
        self.size = size


def takes_num_items(model: nn.Module) -> bool:
    """Whether the model's forward takes Hugging Face's ``num_items_in_batch`` (by name, or ``**loss_kwargs``)."""
    # Each replica would divide by the whole count: not combined.
    if isinstance(model, nn.DataParallel):
        return False
    params = inspect.signature(unwrap(model).forward).parameters
    return "num_items_in_batch" in params or "loss_kwargs" in params


def micro_batch_step(step: Step) -> Callable[[Engine, Batch], torch.Tensor]:
    """The Engine's process function: the batch in parts (``step.micro_batching``), and on a window's last iteration
    the optimizer step. Under ``auto``, a trial that ran out of memory is undone and retried."""
    sizing = step.micro_batching
    assert sizing is not None  # create_trainer runs this step only with a micro-batch size
    model, device, non_blocking, grad_accum_steps = step.model, step.device, step.non_blocking, step.grad_accum_steps
    trial = _Trial(step, sizing, step.loss_fn is None and takes_num_items(model))
    # One size on every rank, also where the file was not seen.
    if sizing.auto and idist.get_world_size() > 1:
        whole = 2**31 - 1
        agreed = int(idist.all_reduce(torch.tensor(sizing.size or whole, device=idist.device()), op="MIN"))
        sizing.size = None if agreed == whole else agreed
    parameters = step.parameters
    finish = optimizer_step(step)
    inner, move = unwrap(model), device.type != "cpu"
    keep_window = sizing.auto and grad_accum_steps > 1
    shares, lockstep = step.shares, trial.lockstep
    clock, add = step.times.clock, step.times.add  # where the step goes (timing.py)

    def train_step(engine: Engine, batch: Batch) -> torch.Tensor:
        if not inner.training:
            model.train()
        start = clock()
        # Counted before the batch moves: on the device, int() would wait for the GPU at every iteration.
        items = counted_items(batch) if trial.pass_items else None
        if move:
            batch = batches.to_device(batch, device, non_blocking)
        last, window = True, 1
        if grad_accum_steps > 1:
            last, window = accumulation_window(engine.state.iteration, engine.state.epoch_length, grad_accum_steps)
        n = batches.size(batch)
        # Collectives in every forward: as many parts on every rank as on the one with the most samples of the batch.
        most = _most_samples(shares, engine.state.iteration, n) if lockstep else 0
        # The window's gradients so far are set aside, so that a trial that fails is undone by dropping its own.
        earlier = [p.grad for p in parameters] if keep_window else []
        if earlier:
            for p in parameters:
                p.grad = None
        # Uneven shares of the global batch: this rank's loss counts by its share (0: a repeat that counts nothing).
        weight = shares.weight(engine.state.iteration) if shares.weights is not None else 1.0
        divisor = window / weight if weight else math.inf
        while True:
            count = sizing.parts(most) if most else 0
            result = trial(batch, n, sizing.current(n), last, divisor, earlier, items, count)
            if isinstance(result, torch.Tensor):
                break
            _undo(model, parameters)
            sizing.shrink(result, n, write=idist.get_rank() == 0)
        sizing.stable += 1
        backward_end = clock()
        if last:
            finish()
        add(start, backward_end, clock() if last else None)
        return result * weight if weight != 1.0 else result

    return train_step


class _Trial:
    """One trial of a batch in parts of ``size``: its loss, or (auto) the smaller size every rank agreed on."""

    def __init__(self, step: Step, sizing: MicroBatching, pass_items: bool) -> None:
        self.compute_loss, self.scaler, self.no_sync = step.compute_loss, step.scaler, step.no_sync
        self.parameters, self.sizing, self.pass_items = step.parameters, sizing, pass_items
        self.world = world = idist.get_world_size()
        self.ddp, fsdp = find_ddp(step.model), find_fsdp(step.model)
        # FSDP's every forward and backward gathers and scatters parameters, and SyncBatchNorm's all-gather their
        # statistics (no_sync does not stop them): a rank out of memory there leaves the others inside a
        # collective, so the ranks cannot retry together; the job restarts from the smaller size.
        sync_bn = any(isinstance(m, nn.SyncBatchNorm) for m in step.model.modules())
        collective = fsdp is not None or sync_bn
        self.in_place = not collective or world == 1
        # For the same reason every rank runs as many parts (DDP's parts under no_sync run no collective).
        self.lockstep = collective and world > 1
        self.empty = any(isinstance(m, BATCH_NORMS) for m in step.model.modules())
        self.agree = sizing.auto and world > 1 and self.in_place
        # The ranks agree on host integers: over gloo, so that a CUDA job does not wait for its device there.
        self.group = (
            dist.new_group(backend="gloo", timeout=stop.group_timeout())
            if self.agree and idist.backend() != "gloo"
            else None
        )

    def __call__(
        self,
        batch: Batch,
        n: int,
        size: int,
        last: bool,
        window: float,
        earlier: list[Any],
        items: int | None,
        count: int,
    ) -> Any:
        # While the size settles, every part skips DDP's sync and the gradients are all-reduced once the ranks
        # agreed: an out-of-memory error anywhere in forward or backward is then retried on every rank.
        manual = self.agree and last and self.ddp is not None and self.sizing.stable < SETTLE_ITERATIONS
        # The buffers' broadcast in the first forward, on every rank alike.
        if self.agree and self.ddp is not None:
            self.ddp.require_forward_param_sync = True
        self.agreed = self.in_collective = False
        proposal = size
        try:
            total = self._parts(batch, n, size, last and not manual, window, earlier, items, count)
        except _Retry as retry:
            return retry.size
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            if self.in_collective or not self.in_place:
                _restart(self.sizing, size, n, err)
            proposal = next_size(size)
        if self.agree and not self.agreed:
            proposal = _agree(proposal, self.group)
        if proposal < size:
            if proposal == 0:
                raise RuntimeError(
                    "train.micro_batch=auto: one sample per process does not fit in memory; free memory on the "
                    "device, or use a smaller model or batch."
                )
            return proposal
        _give_back(self.parameters, earlier)
        if manual:
            _all_reduce_gradients(self.parameters, self.world)
        return total

    def _parts(
        self,
        batch: Batch,
        n: int,
        size: int,
        sync_last: bool,
        window: float,
        earlier: list[Any],
        items: int | None,
        count: int,
    ) -> torch.Tensor:
        """Every part's forward and backward (weighted by its samples), then zero-weight ones up to ``count``; the
        last one syncs when ``sync_last``. ``items``: the batch's counted labels, passed as ``num_items_in_batch``."""
        parts = padded(split_batch(batch, n, size), batch, n, count, self.empty)
        total: torch.Tensor | None = None
        for i, (part, k) in enumerate(parts):
            synced = i == len(parts) - 1 and sync_last
            # With the whole count the model divided by it itself; a part that pads counts nothing (its loss may be
            # NaN, a mean over no sample: the gradients that flow back through a zero weight are zeros all the same).
            share = (1.0 if items is not None else k / n) if k else 0.0
            if synced:
                # Agreed before the synced forward: DDP's forward arms its reducer for the backward's all-reduces,
                # and no_sync does not disarm it, so a rank retrying after it would mix bucket all-reduces with its
                # peer's per-parameter ones. An out-of-memory error from here on takes the restart path.
                if self.agree:
                    self.agreed = True
                    smallest = _agree(size, self.group)
                    if smallest < size:
                        raise _Retry(smallest)
                _give_back(self.parameters, earlier)
                self.in_collective = self.world > 1
            with contextlib.nullcontext() if synced else self.no_sync():
                loss = self._loss({**part, "num_items_in_batch": items} if items is not None else part, k)
                scaled = loss * (share / window) if share != 1.0 or window != 1 else loss
                (self.scaler.scale(scaled) if self.scaler.is_enabled() else scaled).backward()
            if k:
                total = loss.detach() * share if total is None else total + loss.detach() * share
        assert total is not None
        return total

    def _loss(self, part: Batch, k: int) -> torch.Tensor:
        """The part's loss; a model that fails on an empty part that pads is told what it must accept."""
        if k or not self.empty:
            return self.compute_loss(part)
        try:
            return self.compute_loss(part)
        except Exception as err:
            if is_out_of_memory(err):
                raise
            raise RuntimeError(
                "train.micro_batch: this rank's share of the batch is smaller than another's, so it runs an empty "
                "part to match their collectives (FSDP, SyncBatchNorm), and the model failed on it. A model with "
                "BatchNorm must accept a batch of 0 samples here (torch.flatten(x, 1) does, x.view(x.size(0), -1) "
                f"does not), or use a global batch that the processes divide. Cause: {err}"
            ) from err


def _most_samples(shares: Shares, iteration: int, n: int) -> int:
    """The most samples any rank holds of this iteration's batch: the sampler's largest share, or for a loader of
    the user's (shares unknown) the largest ``n``, agreed in a collective."""
    if shares.largest is not None:
        return shares.largest_share(iteration)
    return int(idist.all_reduce(torch.tensor(n, device=idist.device()), op="MAX"))


def _agree(size: int, group: Any) -> int:
    """The smallest size any rank proposes (its own size, or a smaller one after running out of memory)."""
    proposal = torch.tensor([size], dtype=torch.int64)
    dist.all_reduce(proposal, op=dist.ReduceOp.MIN, group=group)
    return int(proposal)


def _give_back(parameters: Sequence[nn.Parameter], earlier: list[Any]) -> None:
    """The window's earlier gradients added back (once) to this iteration's."""
    if earlier:
        for p, g in zip(parameters, earlier, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        earlier.clear()


def _all_reduce_gradients(parameters: Sequence[nn.Parameter], world: int) -> None:
    """DDP's sync by hand: each gradient divided by the world size, then summed over the ranks."""
    handles = [dist.all_reduce(p.grad.div_(world), async_op=True) for p in parameters if p.grad is not None]
    for handle in handles:
        handle.wait()


def _undo(model: nn.Module, parameters: Sequence[nn.Parameter]) -> None:
    """Free what a failed trial held: its gradients, FSDP's gathered parameters, the CUDA cache."""
    for p in parameters:
        p.grad = None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    if torch.cuda.is_available():
        gc.collect()  # the failed trial's tensors that only reference cycles still hold, before the cache goes
        torch.cuda.empty_cache()


def _restart(sizing: MicroBatching, size: int, n: int, err: BaseException) -> None:
    """An out-of-memory error inside a collective: remember the smaller size, and fail for the restart."""
    smaller = next_size(size)
    if sizing.path is not None and smaller:
        sizing.shrink(smaller, n, write=True)
    raise MicroBatchTooLarge(
        f"train.micro_batch=auto: out of memory with {size} samples per part inside a collective (the other ranks "
        f"wait there); {smaller} samples are remembered for the restart (dist.max_restarts). Cause: {err}"
    ) from err
