"""The guard in one process: the collective stop on a non-finite loss or a signal, and when it checks (a fake
clock). Its multi-rank agreement runs in tests/distributed/test_training.py. `python -m pytest tests/test_guard.py`."""

import signal

import pytest
import torch
from ignite.engine import Events
from torch import nn

from ignite_mgpu import guard as guard_module
from ignite_mgpu import stop
from ignite_mgpu.engine import create_trainer
from ignite_mgpu.errors import TrainingDiverged, TrainingInterrupted
from ignite_mgpu.guard import GuardEvents, TrainingGuard
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
    monkeypatch.setattr(guard, "check", lambda e: (guard._losses and checked.append(e.state.iteration), check(e)))
    trainer = Engine(step)
    guard.attach(trainer)
    trainer.run(range(n), max_epochs=epochs)
    return checked


def test_guard_checks_about_once_per_period_and_on_checkpoint_iterations(monkeypatch):
    # 1/16 s per step and a 10/16 s period: after the first step, a check every 10 steps, plus the checkpoint
    # iterations (multiples of 20) and the epoch ends.
    guard = TrainingGuard(period=0.625, sync_every=20)
    assert guard_checks(monkeypatch, guard, 0.0625, n=25, epochs=2) == [1, 11, 20, 25, 35, 40, 50]


def test_guard_interval_adapts_and_respects_the_accumulation_window(monkeypatch):
    slow = TrainingGuard(period=0.625)  # 1 s steps: every step
    assert guard_checks(monkeypatch, slow, 1.0, n=5, epochs=1) == [1, 2, 3, 4, 5]
    fast = TrainingGuard(period=100.0)  # about 1600 steps per period: capped at MAX_INTERVAL
    assert guard_checks(monkeypatch, fast, 0.0625, n=2500, epochs=1) == [1, 1001, 2001, 2500]
    windows = TrainingGuard(period=0.625, multiple_of=4)  # 10 steps, rounded up to a multiple of 4
    assert guard_checks(monkeypatch, windows, 0.0625, n=40, epochs=1) == [4, 16, 28, 40]
    fixed = TrainingGuard(every=6, sync_every=4)
    assert guard_checks(monkeypatch, fixed, 0.0625, n=13, epochs=1) == [4, 6, 8, 12, 13]


def test_guard_restarts_its_schedule_when_the_engine_runs_again():
    from ignite.engine import Engine

    guard = TrainingGuard(every=6)
    trainer = Engine(lambda e, b: torch.tensor(1.0))
    guard.attach(trainer)
    checked = []
    check = guard.check

    def record(engine):
        if guard._losses:
            checked.append(engine.state.iteration)
        check(engine)

    guard.check = record
    trainer.run(range(8), max_epochs=1)
    trainer.run(range(8), max_epochs=1)  # a finished engine starts again from iteration 0
    assert checked == [6, 8, 6, 8]


def test_guard_treats_an_overflowing_loss_sum_as_divergence():
    from ignite.engine import Engine

    trainer = Engine(lambda e, b: torch.tensor(1e308, dtype=torch.float64))  # finite, but two of them are not
    TrainingGuard(every=2).attach(trainer)
    with pytest.raises(TrainingDiverged, match=r"\(the loss sum overflowed\); every rank stopped at iteration 2"):
        trainer.run(range(4), max_epochs=1)
