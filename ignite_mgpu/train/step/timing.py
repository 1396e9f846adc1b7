"""Where this rank's step goes (``StepTimes``): per epoch, the seconds of forward and backward compute, of the
communication the step waits for (DDP's gradient all-reduce at the end of backward, not hidden behind it; FSDP's
all-gathers of each block's parameters before its forward and its backward), and of the optimizer step; the host
clock on the CPU, CUDA events read later on a GPU (never a synchronize per iteration). The epoch log gathers the sums
once per epoch, in the reduction it already makes (``epoch_log.py``); ``runs/bottleneck.py`` judges them."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ignite_mgpu.parallel.strategy import find_ddp
from ignite_mgpu.train.data import batches


def _event() -> torch.cuda.Event:
    """A CUDA event recorded now on the current stream: when the GPU gets there, not when the host does."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepTimes:
    """This rank's step split since the epoch started, in seconds: ``compute`` (forward and backward), ``comm`` (the
    end of backward spent waiting for the gradient all-reduce after the last gradient was handed to it; under FSDP
    the all-gathers its blocks wait for (``note``); not measured under DataParallel or a comm hook of the user's:
    ``measured`` is False, ``seconds()`` gives NaN, and the wait is in ``compute``) and ``optimizer`` (unscale, clip,
    step, zero the gradients, schedule). The step calls ``clock()`` at its start, after backward and after the
    optimizer step, then ``add``: on the CPU three ``perf_counter`` calls and one method call per iteration."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # When backward handed its last gradient bucket to the all-reduce (the comm hook sets it): host seconds, or a
        # CUDA event on a GPU.
        self.ready: Any = None if self.cuda else 0.0
        self.measured = True  # False: the wait for the gradient sync is inside compute
        self.watching = False  # the comm hook's question asked (watch_gradient_sync)
        self.sharded = False  # the communication is FSDP's all-gathers (else DDP's gradient all-reduce)
        self.clock: Any = _event if self.cuda else time.perf_counter
        self.add: Any = self._add_events if self.cuda else self._add
        self._pending: deque[tuple[Any, ...]] = deque()
        self.reset()

    def reset(self) -> None:
        self.compute = self.comm = self.optimizer = 0.0
        # The waits noted in the step so far (FSDP's gathers): host seconds, or (start, end) CUDA events.
        self.gathered: Any = [] if self.cuda else 0.0

    def note(self, start: Any, end: Any) -> None:
        """A wait for communication inside forward or backward, from ``start`` to ``end`` (two ``clock()``s)."""
        if self.cuda:
            self.gathered.append((start, end))
        else:
            self.gathered += end - start

    def _add(self, start: float, backward_end: float, end: float | None = None) -> None:
        # The all-reduce of the last bucket starts when backward's compute ends; the rest of backward is its wait.
        wait = (backward_end - self.ready if self.ready > start else 0.0) + self.gathered
        self.gathered = 0.0
        self.compute += backward_end - start - wait
        self.comm += wait
        if end is not None:
            self.optimizer += end - backward_end

    def _add_events(self, start: Any, backward_end: Any, end: Any = None) -> None:
        self._pending.append((start, backward_end, end, self.ready, self.gathered))
        self.ready, self.gathered = None, []
        # Read the iterations the GPU has finished (query() does not wait); the others at the epoch's end.
        while self._pending and self._last(self._pending[0]).query():
            self._read(self._pending.popleft())

    @staticmethod
    def _last(events: tuple[Any, ...]) -> Any:
        return events[2] if events[2] is not None else events[1]

    def _read(self, events: tuple[Any, ...]) -> None:
        start, backward_end, end, ready, gathered = events
        wait = ready.elapsed_time(backward_end) / 1000 if ready is not None else 0.0
        wait += sum(a.elapsed_time(b) for a, b in gathered) / 1000
        self.compute += start.elapsed_time(backward_end) / 1000 - wait
        self.comm += wait
        if end is not None:
            self.optimizer += backward_end.elapsed_time(end) / 1000

    def seconds(self) -> tuple[float, float, float]:
        """The epoch's sums (compute, comm, optimizer); on a GPU after its last events are read (one wait per
        epoch); comm is NaN where it is not measured."""
        if self._pending:
            self._last(self._pending[-1]).synchronize()
            while self._pending:
                self._read(self._pending.popleft())
        return self.compute, self.comm if self.measured else float("nan"), self.optimizer


def _first(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return done.value()[0]


def watch_gradient_sync(engine: Any, model: nn.Module, times: StepTimes, world_size: int) -> None:
    """Time the wait for the gradient sync: under DDP, a comm hook that is DDP's own all-reduce (as torch's public
    ``allreduce_hook``: divide by the world size, all-reduce) and notes when each bucket is handed over; the last
    one is the end of backward's compute. Without DDP on several processes the wait is not measured (FSDP's
    gathers and reduce-scatters, DataParallel's copies run inside forward and backward), nor where the model has
    a comm hook of its own (DDP takes one); on one plain process there is nothing to wait for. Once per trainer:
    at the first start of its run (``engine``: the trainer, as ignite passes it)."""
    if times.watching:
        return
    times.watching = True
    ddp = find_ddp(model)
    if ddp is None:
        gathers = world_size > 1 and watch_fsdp_gathers(model, times)
        times.sharded = gathers
        times.measured = gathers or (world_size == 1 and not isinstance(model, nn.DataParallel))
        return
    clock, group = times.clock, ddp.process_group
    size = group.size()

    # What torch's allreduce_hook does (divide by the world size, all-reduce the bucket: DDP's default), called on the
    # process group itself: a dozen Python calls fewer per bucket than through dist.all_reduce.
    def timed_allreduce(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        times.ready = clock()
        return group.allreduce([bucket.buffer().div_(size)]).get_future().then(_first)

    # DDP checks the hook's annotations as objects; this module's are strings (``from __future__ import annotations``).
    timed_allreduce.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    try:
        ddp.register_comm_hook(state=group, hook=timed_allreduce)
    except RuntimeError:  # the user's own hook: DDP takes only one
        times.measured = False


def watch_fsdp_gathers(model: nn.Module, times: StepTimes) -> bool:
    """Time the all-gathers that FSDP2's blocks wait for (``times.note``): around FSDP's own pre-forward hook of
    each block (its parameters gathered, waited for and copied out) and its pre-backward hook (gathered again where
    forward resharded them), by hooks registered before it (``prepend``) and after it. The reduce-scatters of the
    gradients stay in compute. False where the model has no FSDP2 block."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch before FSDP2's public module
        return False
    blocks = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for block in blocks:
        _around_fsdp_hooks(block, times)
    return bool(blocks)


def _around_fsdp_hooks(block: nn.Module, times: StepTimes) -> None:
    started: list[Any] = []  # a stack: a backward's several output tensors each run the pair

    def before(*_: Any) -> None:
        if block.training:
            started.append(times.clock())

    def after(*_: Any) -> None:
        if started:
            times.note(started.pop(), times.clock())

    def on_gradients(hook: Any) -> Any:
        # FSDP registers its pre-backward hook on the block's outputs in its forward hook; a tensor runs its hooks in
        # the order they were registered.
        def register(module: nn.Module, args: Any, output: Any) -> None:
            if block.training and torch.is_grad_enabled():
                for tensor in batches.tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(hook)

        return register

    block.register_forward_pre_hook(before, prepend=True)
    block.register_forward_pre_hook(after)
    block.register_forward_hook(on_gradients(before), prepend=True)
    block.register_forward_hook(on_gradients(after))
