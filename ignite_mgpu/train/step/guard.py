"""The guard: every rank stops at the same iteration on a non-finite loss or a stop signal, with one small
collective about once a second instead of one per step. The same collective yields the training loss averaged over
ranks and the shared decision to checkpoint (every N iterations or minutes), always at the end of an accumulation
window."""

from __future__ import annotations

import math
import time
import weakref
from typing import Any, NamedTuple

import ignite.distributed as idist
import torch
from ignite.engine import Engine, EventEnum, Events

from ignite_mgpu.env import stop
from ignite_mgpu.errors import TrainingDiverged, TrainingInterrupted


class GuardEvents(EventEnum):
    # Fired on every rank before a stop on a signal: attach the last checkpoint here.
    STOPPING = "stopping"
    # A periodic checkpoint is due: every rank, the same iteration, a window's end.
    CHECKPOINT = "checkpoint"


class RankCheck(NamedTuple):
    """What one rank tells the others at a check (gathered as one float64 row per rank)."""

    stop_signal: float  # the first stop signal this rank received, 0: none
    loss_sum: float  # of its losses since the last check: non-finite when any of them is
    losses: float  # how many losses (iterations) that sum holds
    seconds: float  # training time since the last check
    unsaved_seconds: float  # since the last checkpoint


def _resumed_sums(state: Any) -> tuple[float, float]:
    """The loss sum and count an epoch starts from: those its checkpoint carried (``state.resumed_epoch_loss``:
    [sum, iterations, iteration] as ``epoch_sums`` counts them, set by a resume) when it is resumed mid-way at that
    iteration, so that its train_loss is the whole epoch's, as an uninterrupted run reports it; else nothing."""
    saved, state.resumed_epoch_loss = getattr(state, "resumed_epoch_loss", None), None
    mid_epoch = bool(state.epoch_length) and state.iteration % state.epoch_length != 0
    if saved and len(saved) == 3 and int(saved[2]) == state.iteration and mid_epoch:
        return float(saved[0]), float(saved[1])
    return 0.0, 0.0


def epoch_sums(rows: list[RankCheck]) -> tuple[float, float]:
    """What one check adds to its epoch's loss sums: the sum of the global batch's mean losses over the iterations it
    covers, and how many iterations. Each iteration's mean over the ranks is the global batch's mean (the step
    weights uneven shares), so the epoch's train_loss is the mean over its samples whatever the process counts: an
    epoch resumed on another number of processes weights every iteration alike."""
    ranks = len(rows)
    return sum(row.loss_sum for row in rows) / ranks, sum(row.losses for row in rows) / ranks


def gather_checks(local: RankCheck) -> list[RankCheck]:
    """Every rank's row, in rank order (one small all_gather; none in a single process)."""
    if idist.get_world_size() == 1:
        return [local]
    rows = torch.as_tensor(idist.all_gather(torch.tensor(local, dtype=torch.float64))).view(-1, len(RankCheck._fields))
    return [RankCheck(*row) for row in rows.tolist()]


def accumulation_window(iteration: int, epoch_length: int | None, size: int) -> tuple[bool, int]:
    """(whether ``iteration`` ends a gradient-accumulation window, that window's length).

    Windows restart with every epoch, so a checkpoint or a stop at an epoch's end never falls inside one: an
    epoch of 10 iterations with ``size=3`` has windows 1-3, 4-6, 7-9 and the short 10. Without a known epoch
    length the windows count the global iteration.
    """
    if size == 1:
        return True, 1
    if not epoch_length:
        return iteration % size == 0, size
    position = (iteration - 1) % epoch_length + 1
    tail = epoch_length % size
    length = tail if tail and position > epoch_length - tail else size
    return position % size == 0 or position == epoch_length, length


def next_window_end(iteration: int, epoch_length: int | None, size: int) -> int:
    """The first iteration at or after ``iteration`` that ends an accumulation window."""
    if size == 1:
        return iteration
    if not epoch_length:
        return iteration + -iteration % size
    start = (iteration - 1) // epoch_length * epoch_length
    position = iteration - start
    return start + min(epoch_length, position + -position % size)


class TrainingGuard:
    """Stops all ranks at the same iteration on a non-finite loss or a stop signal, without a per-step collective.

    One small ``all_gather`` per check shares each rank's stop signal, loss sum and timing. One rank stopping
    alone would leave the others waiting in their next all-reduce, so the decision is collective. The same gather
    yields the loss averaged over ranks: ``engine.state.running_loss`` (since the last check) and
    ``engine.state.metrics["train_loss"]`` (epoch).

    When it checks: every ``check_every`` iterations; with ``check_every=0`` about once per ``period`` seconds of
    training, an interval that every rank derives from the same gathered timings (a collective per step costs a
    tiny model a few percent of its step time). Also at each epoch end and on every multiple of
    ``checkpoint_every_iters`` (nothing is then ever saved after an unchecked NaN). Checks fall on the ends of
    accumulation windows of ``grad_accum_steps`` iterations (``accumulation_window``), so a stop always falls on an
    optimizer step.

    ``GuardEvents.CHECKPOINT`` fires after a check on a multiple of ``checkpoint_every_iters`` (the end of the window
    holding it) and once ``checkpoint_every_minutes`` have passed since the last one: the ranks decide from the
    gathered rows, so they agree. A checkpoint or a stop decided at an epoch's last iteration waits until every
    other handler of that epoch's end (validation, the epoch log) has run: a checkpoint of a finished epoch is
    resumed after that epoch, whose end would otherwise never run. Every iteration is noted for the supervisor
    (``stop.note_iteration``), which names the work a restart loses.
    """

    MAX_INTERVAL = 1000  # iterations: bounds the losses kept between checks on very fast steps
    # The losses since the last check are stacked into one tensor every STACK_EVERY iterations: a Python object
    # held per iteration made every garbage collection longer, which cost more than the rest of the guard.
    STACK_EVERY = 64

    def __init__(
        self,
        check_every: int = 0,
        *,
        period: float = 1.0,
        checkpoint_every_iters: int = 0,
        grad_accum_steps: int = 1,
        checkpoint_every_minutes: float | None = None,
    ) -> None:
        minutes = checkpoint_every_minutes
        minutes_ok = minutes is None or minutes > 0
        if check_every < 0 or period <= 0 or checkpoint_every_iters < 0 or grad_accum_steps < 1 or not minutes_ok:
            raise ValueError(
                f"TrainingGuard(check_every={check_every}, period={period}, checkpoint_every_iters="
                f"{checkpoint_every_iters}, grad_accum_steps={grad_accum_steps}, checkpoint_every_minutes={minutes}): "
                "use check_every >= 0 (0: about every `period` seconds), period > 0, checkpoint_every_iters >= 0, "
                "grad_accum_steps >= 1, checkpoint_every_minutes None or > 0."
            )
        self.check_every, self.period = check_every, period
        self.checkpoint_every_iters, self.grad_accum_steps = checkpoint_every_iters, grad_accum_steps
        self.checkpoint_seconds = 60.0 * minutes if minutes else 0.0
        self._saved_at = time.monotonic()  # the last periodic checkpoint (or the start)
        self._saved_iteration = -1
        # (checkpoint, stop signal) due once the epoch has ended.
        self._at_epoch_end: tuple[bool, int] = (False, 0)
        self._late = False
        self._next = 0  # iteration of the next scheduled check, set when an epoch starts
        self._since = 0.0  # perf_counter() at the last check or epoch start
        self._losses: list[torch.Tensor] = []  # since the last check or stack
        self._stacked: list[torch.Tensor] = []  # STACK_EVERY losses each, since the last check
        self._epoch_sum = 0.0
        self._epoch_count = 0.0
        self._engine: weakref.ref[Engine] | None = None

    def attach(self, engine: Engine) -> None:
        """Attach to ``engine``, the one engine this guard watches."""
        if self._engine is not None:
            raise ValueError("this TrainingGuard is attached already: create one guard per engine.")
        # The per-iteration handler takes no engine argument: ignite then calls it without resolving its own weak
        # reference (a third of the cost of calling a handler); the guard keeps its own.
        self._engine = weakref.ref(engine)
        engine.register_events(*GuardEvents)
        # Shown by the progress bar.
        engine.state.running_loss = math.nan  # type: ignore[attr-defined]
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(GuardEvents.CHECKPOINT, self._checkpointed)
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.ITERATION_STARTED, self._first_batch)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)

    def _started(self, engine: Engine) -> None:  # every run(), also a second one on the same engine
        self._next, self._losses, self._stacked = 0, [], []
        self._saved_at, self._at_epoch_end = time.monotonic(), (False, 0)
        stop.note_activity()  # the hang watch starts here: the time before the first iteration counts as its work
        stop.note_waypoint()
        # Attached now, so it runs after every epoch-end handler attached before run()
        if not self._late:
            self._late = True
            engine.add_event_handler(Events.EPOCH_COMPLETED, self._after_epoch_end)

    def _first_batch(self, engine: Engine) -> None:
        # Once: the hang watch judges a rank still without its first batch while the others have theirs.
        stop.note_waypoint()
        engine.remove_event_handler(self._first_batch, Events.ITERATION_STARTED)

    def _checkpointed(self, engine: Engine) -> None:
        self._saved_at, self._saved_iteration = time.monotonic(), engine.state.iteration

    def _after_epoch_end(self, engine: Engine) -> None:
        checkpoint, signum = self._at_epoch_end
        self._at_epoch_end = (False, 0)
        # Not saved by the epoch schedule.
        if checkpoint and self._saved_iteration != engine.state.iteration:
            engine.fire_event(GuardEvents.CHECKPOINT)
        if signum:
            self._stop(engine, signum)

    def _stop(self, engine: Engine, signum: int) -> None:
        engine.fire_event(GuardEvents.STOPPING)
        raise TrainingInterrupted(signum, engine.state.iteration)

    def _epoch_started(self, engine: Engine) -> None:
        self._epoch_sum, self._epoch_count = _resumed_sums(engine.state)
        engine.state.epoch_loss = [self._epoch_sum, self._epoch_count]  # type: ignore[attr-defined]
        # The time between epochs (validation, checkpoints) is not training.
        self._since = time.perf_counter()
        # A new run, or resumed: the same iteration on every rank.
        if self._next <= engine.state.iteration:
            # Check right after the first step: it shows that every rank is alive and times a step.
            self._next = self._schedule(engine.state.iteration, 1, engine.state.epoch_length)

    def _schedule(self, iteration: int, interval: int, epoch_length: int | None) -> int:
        """The next check after ``iteration``: the next multiple of ``check_every``, or (auto) about ``interval`` later,
        moved to the end of the accumulation window it falls in."""
        if self.check_every:
            after = (iteration // self.check_every + 1) * self.check_every
        else:
            after = iteration + min(max(interval, 1), self.MAX_INTERVAL)
        return next_window_end(after, epoch_length, self.grad_accum_steps)

    def _sync_due(self, iteration: int, epoch_length: int | None) -> bool:
        """A multiple of ``checkpoint_every_iters`` lies in the accumulation window that ends at ``iteration``."""
        if self.grad_accum_steps == 1:
            return iteration % self.checkpoint_every_iters == 0
        ends, length = accumulation_window(iteration, epoch_length, self.grad_accum_steps)
        return ends and iteration // self.checkpoint_every_iters > (iteration - length) // self.checkpoint_every_iters

    def _on_iteration(self) -> None:  # every iteration: as little as possible
        # Set by attach; it runs this, so it lives.
        engine: Engine = self._engine()  # type: ignore[misc, assignment]
        state, losses = engine.state, self._losses
        losses.append(state.output)  # type: ignore[arg-type]  # the trainer returns the loss tensor
        if len(losses) == self.STACK_EVERY:
            self._stacked.append(torch.stack(losses))
            losses.clear()
        iteration = state.iteration
        stop.note_iteration(iteration)  # one store into a shared page: how much a restart would lose
        if iteration >= self._next or (self.checkpoint_every_iters and self._sync_due(iteration, state.epoch_length)):
            self.check(engine)

    def pending(self) -> int:
        """How many iterations' losses the next check will look at."""
        return len(self._losses) + self.STACK_EVERY * len(self._stacked)

    def _on_epoch_completed(self, engine: Engine) -> None:
        self.check(engine)
        if self._epoch_count:
            engine.state.metrics["train_loss"] = self._epoch_sum / self._epoch_count

    def check(self, engine: Engine) -> None:
        """Run the collective check now (on every rank at the same iteration). Raises TrainingStopped."""
        if not self.pending():
            return  # every rank has the same iteration count, so all of them skip together
        parts = [*self._stacked, torch.stack(self._losses)] if self._losses else self._stacked
        losses = torch.cat(parts).detach().double().cpu()
        self._losses, self._stacked = [], []
        now = time.perf_counter()
        # A NaN or Inf anywhere makes the float64 sum non-finite: one number carries the non-finite check.
        unsaved = time.monotonic() - self._saved_at
        local = RankCheck(stop.stop_requested(), float(losses.sum()), len(losses), now - self._since, unsaved)
        self._since = now
        rows = gather_checks(local)
        if not all(math.isfinite(row.loss_sum) for row in rows):
            self._diverged(engine, losses)
        iteration, epoch_length = engine.state.iteration, engine.state.epoch_length
        epoch_end = bool(epoch_length) and iteration % epoch_length == 0  # type: ignore[operator]
        total, iterations = epoch_sums(rows)
        engine.state.running_loss = total / iterations  # type: ignore[attr-defined]
        self._epoch_sum += total
        self._epoch_count += iterations
        # Before a stop: the stop's checkpoint carries the epoch's sums up to its iteration.
        engine.state.epoch_loss = [self._epoch_sum, self._epoch_count]  # type: ignore[attr-defined]
        signum = int(max(row.stop_signal for row in rows))
        if signum and not epoch_end:
            self._stop(engine, signum)
        # The same rows on every rank, so the same interval everywhere.
        seconds_per_iteration = max(row.seconds / row.losses for row in rows)
        interval = round(self.period / max(seconds_per_iteration, 1e-9))
        self._next = self._schedule(iteration, interval, epoch_length)
        due = bool(self.checkpoint_every_iters) and self._sync_due(iteration, epoch_length)
        unsaved_most = max(row.unsaved_seconds for row in rows)
        due = due or bool(self.checkpoint_seconds) and unsaved_most >= self.checkpoint_seconds
        if epoch_end:
            self._at_epoch_end = (self._at_epoch_end[0] or due, signum)
        elif due:
            engine.fire_event(GuardEvents.CHECKPOINT)

    def _diverged(self, engine: Engine, losses: torch.Tensor) -> None:
        """Some rank saw a non-finite loss: find the first such iteration over all ranks (a second gather)."""
        bad = ~torch.isfinite(losses)
        first = engine.state.iteration - len(losses) + 1 + int(bad.int().argmax()) if bad.any() else 0
        local = torch.tensor([first], dtype=torch.float64)
        found = torch.as_tensor(idist.all_gather(local)).tolist() if idist.get_world_size() > 1 else [first]
        iteration, rank = min(((int(it), rank) for rank, it in enumerate(found) if it > 0), default=(0, -1))
        where = f"at iteration {iteration} on rank {rank}" if iteration else "(the loss sum overflowed)"
        raise TrainingDiverged(
            f"non-finite loss (NaN or Inf) {where}; every rank stopped at "
            f"iteration {engine.state.iteration} and nothing was saved after the non-finite loss, so the last "
            "checkpoint is intact. Lower optim.lr, set train.clip_grad_norm, or check the input data."
        )
