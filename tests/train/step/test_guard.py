"""The guard in one process: the collective stop on a non-finite loss or a signal, and when it checks (a fake
clock). Its multi-rank agreement runs in tests/distributed/test_training.py.
`python -m pytest tests/train/step/test_guard.py`."""

import signal

import pytest
import torch
from ignite.engine import Events
from torch import nn

from ignite_mgpu.env import stop
from ignite_mgpu.errors import TrainingDiverged, TrainingInterrupted
from ignite_mgpu.train.step import guard as guard_module
from ignite_mgpu.train.step.guard import GuardEvents, TrainingGuard
from ignite_mgpu.train.step.trainer import create_trainer
from tests.helpers import LossModel, data, linear


def test_guard_stops_on_nan_naming_the_iteration():
    class NanAt(LossModel):
        def forward(self, x, y=None):
            self.calls = getattr(self, "calls", 0) + 1
            loss = super().forward(x, y)
            return loss * float("nan") if self.calls == 6 else loss

    model = NanAt()
    saved = []
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, device="cpu", check_every=4)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: saved.append(e.state.iteration))
    with pytest.raises(TrainingDiverged, match="iteration 6 on rank 0; every rank stopped at iteration 8") as err:
        trainer.run(data(n=80), max_epochs=1)
    assert err.value.exit_code == 3


def test_guard_stops_on_signal_after_the_stopping_event():
    model = linear()
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu", check_every=3
    )
    stopping = []
    trainer.add_event_handler(GuardEvents.STOPPING, lambda e: stopping.append(e.state.iteration))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda: stop.request_stop(signal.SIGTERM))
    with pytest.raises(TrainingInterrupted, match="SIGTERM at iteration 3") as err:
        trainer.run(data(n=80), max_epochs=1)
    assert err.value.exit_code == 143 and stopping == [3]


def guard_checks(monkeypatch, guard, step_seconds, n, epochs):
    """Iterations at which ``guard`` ran a check, on a clock that advances ``step_seconds`` per iteration."""
    from ignite.engine import Engine

    clock = [0.0]
    monkeypatch.setattr(guard_module.time, "perf_counter", lambda: clock[0])

    def step(engine, batch):
        clock[0] += step_seconds
        return torch.tensor(1.0)

    checked = []
    check = guard.check
    monkeypatch.setattr(guard, "check", lambda e: (guard.pending() and checked.append(e.state.iteration), check(e)))
    trainer = Engine(step)
    guard.attach(trainer)
    trainer.run(range(n), max_epochs=epochs)
    return checked


def test_guard_checks_about_once_per_period_and_on_checkpoint_iterations(monkeypatch):
    # 1/16 s per step and a 10/16 s period: after the first step, a check every 10 steps, plus the checkpoint
    # iterations (multiples of 20) and the epoch ends.
    guard = TrainingGuard(period=0.625, checkpoint_every_iters=20)
    assert guard_checks(monkeypatch, guard, 0.0625, n=25, epochs=2) == [1, 11, 20, 25, 35, 40, 50]


def test_guard_interval_adapts_and_respects_the_accumulation_window(monkeypatch):
    slow = TrainingGuard(period=0.625)  # 1 s steps: every step
    assert guard_checks(monkeypatch, slow, 1.0, n=5, epochs=1) == [1, 2, 3, 4, 5]
    fast = TrainingGuard(period=100.0)  # about 1600 steps per period: capped at MAX_INTERVAL
    assert guard_checks(monkeypatch, fast, 0.0625, n=2500, epochs=1) == [1, 1001, 2001, 2500]
    windows = TrainingGuard(period=0.625, grad_accum_steps=4)  # 10 steps, rounded up to a multiple of 4
    assert guard_checks(monkeypatch, windows, 0.0625, n=40, epochs=1) == [4, 16, 28, 40]
    fixed = TrainingGuard(check_every=6, checkpoint_every_iters=4)
    assert guard_checks(monkeypatch, fixed, 0.0625, n=13, epochs=1) == [4, 6, 8, 12, 13]


def test_guard_restarts_its_schedule_when_the_engine_runs_again():
    from ignite.engine import Engine

    guard = TrainingGuard(check_every=6)
    trainer = Engine(lambda e, b: torch.tensor(1.0))
    guard.attach(trainer)
    checked = []
    check = guard.check

    def record(engine):
        if guard.pending():
            checked.append(engine.state.iteration)
        check(engine)

    guard.check = record
    trainer.run(range(8), max_epochs=1)
    trainer.run(range(8), max_epochs=1)  # a finished engine starts again from iteration 0
    assert checked == [6, 8, 6, 8]


def test_a_non_finite_loss_is_found_among_the_stacked_ones():
    """Losses are stacked every STACK_EVERY iterations between checks: the first bad one is still named exactly, and
    the epoch's train_loss is the mean over every iteration."""
    from ignite.engine import Engine

    every = TrainingGuard.STACK_EVERY
    bad = every + 5  # in the second stack, before the check
    trainer = Engine(lambda e, b: torch.tensor(float("nan") if e.state.iteration == bad else e.state.iteration))
    guard = TrainingGuard(check_every=3 * every)
    guard.attach(trainer)
    stopped = f"iteration {bad} on rank 0; every rank stopped at iteration {3 * every}"
    with pytest.raises(TrainingDiverged, match=stopped):
        trainer.run(range(4 * every), max_epochs=1)
    finite = Engine(lambda e, b: torch.tensor(float(e.state.iteration)))
    counting = TrainingGuard(check_every=2 * every + 7)
    counting.attach(finite)
    seen = []
    finite.add_event_handler(Events.ITERATION_COMPLETED(once=2 * every + 6), lambda: seen.append(counting.pending()))
    n = 3 * every
    finite.run(range(n), max_epochs=1)
    assert seen == [2 * every + 6] and finite.state.metrics["train_loss"] == (n + 1) / 2


def test_a_guard_watches_one_engine():
    from ignite.engine import Engine

    guard = TrainingGuard()
    guard.attach(Engine(lambda e, b: torch.tensor(1.0)))
    with pytest.raises(ValueError, match="attached already: create one guard per engine"):
        guard.attach(Engine(lambda e, b: torch.tensor(1.0)))


def test_guard_treats_an_overflowing_loss_sum_as_divergence():
    from ignite.engine import Engine

    trainer = Engine(lambda e, b: torch.tensor(1e308, dtype=torch.float64))  # finite, but two of them are not
    TrainingGuard(check_every=2).attach(trainer)
    with pytest.raises(TrainingDiverged, match=r"\(the loss sum overflowed\); every rank stopped at iteration 2"):
        trainer.run(range(4), max_epochs=1)


# ----------------------------------------------------------------------------------------------- windows, checkpoints


def test_accumulation_windows_restart_every_epoch():
    from ignite_mgpu.train.step.guard import accumulation_window, next_window_end

    # 10 iterations per epoch, windows of 3: 1-3, 4-6, 7-9 and the short 10; the next epoch starts afresh at 11.
    ends = [it for it in range(1, 21) if accumulation_window(it, 10, 3)[0]]
    assert ends == [3, 6, 9, 10, 13, 16, 19, 20]
    assert [accumulation_window(it, 10, 3)[1] for it in (1, 9, 10, 11, 20)] == [3, 3, 1, 3, 1]
    assert [next_window_end(it, 10, 3) for it in (1, 3, 4, 10, 11, 19, 20)] == [3, 3, 6, 10, 13, 19, 20]
    assert accumulation_window(7, None, 3) == (False, 3) and next_window_end(7, None, 3) == 9  # length unknown
    assert accumulation_window(7, 10, 1) == (True, 1) and next_window_end(7, 10, 1) == 7


def test_checks_fall_on_window_ends_when_the_epoch_does_not_divide(monkeypatch):
    windows = TrainingGuard(
        period=0.3125, grad_accum_steps=3
    )  # 1/16 s steps: about every 5 steps, moved to a window end
    assert guard_checks(monkeypatch, windows, 0.0625, n=10, epochs=2) == [3, 9, 10, 16, 20]
    fixed = TrainingGuard(check_every=6, grad_accum_steps=3, checkpoint_every_iters=3)
    assert guard_checks(monkeypatch, fixed, 0.0625, n=10, epochs=2) == [3, 6, 9, 10, 13, 16, 19, 20]


def events(monkeypatch, guard, step_seconds, n, epochs, stop_at=None):
    """What happened, in order: ("checkpoint", iteration) for GuardEvents.CHECKPOINT, ("stopping", iteration),
    ("epoch end", epoch) for a handler attached after the guard (the evaluation and epoch report in training)."""
    from ignite.engine import Engine

    clock = [0.0]
    monkeypatch.setattr(guard_module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(guard_module.time, "monotonic", lambda: clock[0])

    def step(engine, batch):
        clock[0] += step_seconds
        if engine.state.iteration == stop_at:
            stop.request_stop(signal.SIGTERM)
        return torch.tensor(1.0)

    trainer = Engine(step)
    guard.attach(trainer)
    seen = []
    trainer.add_event_handler(GuardEvents.CHECKPOINT, lambda e: seen.append(("checkpoint", e.state.iteration)))
    trainer.add_event_handler(GuardEvents.STOPPING, lambda e: seen.append(("stopping", e.state.iteration)))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen.append(("epoch end", e.state.epoch)))
    try:
        trainer.run(range(n), max_epochs=epochs)
    except TrainingInterrupted as err:
        seen.append(("stopped", str(err)))
    return seen


def test_iteration_checkpoints_fall_at_the_end_of_the_window_holding_the_multiple(monkeypatch):
    # every_iters=4 with windows of 3 in epochs of 10: multiples 4, 8 | 12, 16, 20 -> window ends 6, 9 | 13, 16, 20;
    # the one at an epoch's last iteration waits for that epoch's other end handlers (validation, report).
    guard = TrainingGuard(check_every=100, checkpoint_every_iters=4, grad_accum_steps=3)
    assert events(monkeypatch, guard, 0.0625, n=10, epochs=2) == [
        ("checkpoint", 6),
        ("checkpoint", 9),
        ("epoch end", 1),
        ("checkpoint", 13),
        ("checkpoint", 16),
        ("epoch end", 2),
        ("checkpoint", 20),
    ]


def test_time_based_checkpoints_are_decided_together_at_a_check(monkeypatch):
    # 1 s steps, a check every step, a checkpoint every 3 s (0.05 min): the clock restarts at every checkpoint.
    guard = TrainingGuard(check_every=1, checkpoint_every_minutes=0.05)
    seen = events(monkeypatch, guard, 1.0, n=12, epochs=1)
    assert seen == [("checkpoint", 3), ("checkpoint", 6), ("checkpoint", 9), ("epoch end", 1), ("checkpoint", 12)]
    with pytest.raises(ValueError, match="checkpoint_every_minutes None or > 0"):
        TrainingGuard(checkpoint_every_minutes=0)


def test_a_stop_at_an_epochs_last_iteration_waits_for_the_epochs_end(monkeypatch):
    # Resuming from a checkpoint of a finished epoch continues with the next one: its evaluation and report must
    # have run before the stop's checkpoint is written.
    seen = events(monkeypatch, TrainingGuard(check_every=1), 0.1, n=10, epochs=2, stop_at=10)
    assert seen == [
        ("epoch end", 1),
        ("stopping", 10),
        ("stopped", "stopped by SIGTERM at iteration 10; every rank stopped at the same iteration"),
    ]
    stop.reset()
    seen = events(monkeypatch, TrainingGuard(check_every=1), 0.1, n=10, epochs=2, stop_at=7)
    assert seen[-2:] == [
        ("stopping", 7),
        ("stopped", "stopped by SIGTERM at iteration 7; every rank stopped at the same iteration"),
    ]


def test_every_check_tells_the_supervisor_how_far_training_got(tmp_path):
    from ignite.engine import Engine

    stop.set_status_file(tmp_path / "status0")
    trainer = Engine(lambda e, b: torch.tensor(1.0))
    TrainingGuard(check_every=4).attach(trainer)
    trainer.run(range(10), max_epochs=1)
    assert stop.read_status(tmp_path / "status0")[:2] == (10, False)
    with stop.saving():
        assert stop.read_status(tmp_path / "status0")[:2] == (10, True)
    assert stop.read_status(tmp_path / "status0")[:2] == (10, False)
    assert stop.read_status(tmp_path / "missing") is None


def test_the_trainers_start_and_its_first_batch_are_waypoints(tmp_path):
    """Before the first iteration the hang watch judges a rank behind the others' waypoints (hangs/watch.py)."""
    from ignite.engine import Engine, Events

    stop.set_status_file(tmp_path / "status0")
    trainer = Engine(lambda e, b: torch.tensor(1.0))
    TrainingGuard(check_every=4).attach(trainer)
    seen = []

    @trainer.on(Events.STARTED)
    @trainer.on(Events.ITERATION_STARTED)
    def look() -> None:
        seen.append(stop.read_status(tmp_path / "status0"))

    trainer.run(range(3), max_epochs=1)
    assert [(s.waypoints, s.activity) for s in seen] == [(1, 1), (2, 1), (2, 1), (2, 1)]


def test_an_epoch_whose_process_count_changed_reports_the_mean_over_its_samples():
    """An epoch of 20 iterations, lent 4 -> 2 processes after iteration 11: each check adds the global batch's mean
    losses and the iterations (``epoch_sums``), so the epoch's train_loss is the uninterrupted run's (the sums of
    every rank and iterations x ranks weighted the iterations before the change by the old process count)."""
    from ignite_mgpu.train.step.guard import RankCheck, epoch_sums

    means = [2.0 - 0.05 * i for i in range(1, 21)]  # the global batch's mean loss of each iteration
    spread = {4: [-0.3, -0.1, 0.1, 0.3], 2: [-0.2, 0.2]}  # each rank's share differs, its mean is the batch's

    def check(iterations: range, ranks: int) -> list[RankCheck]:
        sums = [sum(means[i - 1] + spread[ranks][r] for i in iterations) for r in range(ranks)]
        return [RankCheck(0, s, len(iterations), 1.0, 0.0) for s in sums]

    checks = [check(range(1, 6), 4), check(range(6, 12), 4), check(range(12, 21), 2)]  # one check after the change
    total, iterations = map(sum, zip(*(epoch_sums(rows) for rows in checks), strict=True))
    assert iterations == 20 and total / iterations == pytest.approx(sum(means) / 20, abs=1e-12)
