"""Where this rank's step goes (``StepTimes``): per epoch, the seconds of forward and backward compute, of the gradient
all-reduce that backward waits for at its end (DDP's, not hidden behind backward), and of the optimizer step; the host
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


def _event() -> torch.cuda.Event:
    """A CUDA event recorded now on the current stream: when the GPU gets there, not when the host does."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepTimes:
    """This rank's step split since the epoch started, in seconds: ``compute`` (forward and backward), ``comm`` (the
    end of backward spent waiting for the gradient all-reduce after the last gradient was handed to it; not measured
    under FSDP, DataParallel or a comm hook of the user's: ``measured`` is False, ``seconds()`` gives NaN, and the
    wait is in ``compute``) and ``optimizer`` (unscale, clip, step, zero the gradients, schedule). The step calls
    ``clock()`` at its start, after backward and after the optimizer step, then ``add``: on the CPU three
    ``perf_counter`` calls and one method call per iteration."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # When backward handed its last gradient bucket to the all-reduce (the comm hook sets it): host seconds, or a
        # CUDA event on a GPU.
        self.ready: Any = None if self.cuda else 0.0
        self.measured = True  # False: the wait for the gradient sync is inside compute
        self.watching = False  # the comm hook's question asked (watch_gradient_sync)
        self.clock: Any = _event if self.cuda else time.perf_counter
        self.add: Any = self._add_events if self.cuda else self._add
        self._pending: deque[tuple[Any, ...]] = deque()
        self.reset()

    def reset(self) -> None:
        self.compute = self.comm = self.optimizer = 0.0

    def _add(self, start: float, backward_end: float, end: float | None = None) -> None:
        # The all-reduce of the last bucket starts when backward's compute ends; the rest of backward is its wait.
        wait = backward_end - self.ready if self.ready > start else 0.0
        self.compute += backward_end - start - wait
        self.comm += wait
        if end is not None:
            self.optimizer += end - backward_end

    def _add_events(self, start: Any, backward_end: Any, end: Any = None) -> None:
        self._pending.append((start, backward_end, end, self.ready))
        self.ready = None
        # Read the iterations the GPU has finished (query() does not wait); the others at the epoch's end.
        while self._pending and self._last(self._pending[0]).query():
            self._read(self._pending.popleft())

    @staticmethod
    def _last(events: tuple[Any, ...]) -> Any:
        return events[2] if events[2] is not None else events[1]

    def _read(self, events: tuple[Any, ...]) -> None:
        start, backward_end, end, ready = events
        wait = ready.elapsed_time(backward_end) / 1000 if ready is not None else 0.0
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
        times.measured = world_size == 1 and not isinstance(model, nn.DataParallel)
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
