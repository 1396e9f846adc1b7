"""create_trainer / create_evaluator in one process: accumulation, clipping, precision, loss-in-forward,
sampler epochs, and the guard's collective stop. `python -m pytest tests/test_engine.py`."""

import math
import signal

import pytest
import torch
from ignite.engine import Events
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ignite_mgpu import handlers
from ignite_mgpu.engine import create_evaluator, create_lr_scheduler, create_trainer, unwrap
from ignite_mgpu.handlers import GuardEvents, TrainingDiverged, TrainingInterrupted, reduce_replica_losses


def data(n=32, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(6, 3)


def fit(model, loader, epochs=1, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), device="cpu", **kwargs)
    trainer.run(loader, max_epochs=epochs)
    return trainer


def test_accumulation_equals_the_large_batch():
    a, b = linear(), linear()
    fit(a, data(batch=8))
    fit(b, data(batch=4), grad_accum_steps=2)  # two micro-batches of 4 make one step of 8
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)


def test_clipping_bounds_the_update():
    model = linear()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), device="cpu", clip_grad_norm=0.01)
    trainer.run(data(n=8, batch=8), max_epochs=1)
    step = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), before, strict=True)])
    assert step.norm() <= 0.01 + 1e-6


def test_bf16_on_cpu_trains_and_fp16_is_refused():
    trainer = fit(linear(), data(), epochs=3, precision="bf16")
    assert math.isfinite(float(trainer.state.output))
    with pytest.raises(ValueError, match="fp16.*needs CUDA.*bf16"):
        create_trainer(linear(), torch.optim.SGD(linear().parameters(), lr=0.1), None, device="cpu", precision="fp16")
    with pytest.raises(ValueError, match="precision='fp8'"):
        create_trainer(linear(), torch.optim.SGD(linear().parameters(), lr=0.1), None, precision="fp8")


class Recorder(nn.Linear):
    """A Linear layer that records the dtype of each forward's output (bfloat16 under CPU autocast)."""

    def __init__(self):
        super().__init__(6, 3)
        self.dtypes = []

    def forward(self, x):
        out = super().forward(x)
        self.dtypes.append(out.dtype)
        return out


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_forward_runs_under_autocast_only_for_bf16(precision, dtype):
    model = Recorder()
    fit(model, data(n=16), precision=precision)
    create_evaluator(model, {}, device="cpu", precision=precision).run(data(n=8))
    assert model.dtypes == [dtype] * 3  # two training batches and one validation batch
    assert not torch.is_autocast_enabled("cpu")  # nothing left switched on


@pytest.mark.parametrize(("precision", "entered"), [("fp32", 0), ("bf16", 4)])
def test_the_fp32_step_enters_no_context(precision, entered):
    import contextlib
    import sys

    from torch.amp import autocast_mode

    files = {contextlib.__file__, autocast_mode.__file__}
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__enter__" and frame.f_code.co_filename in files:
            calls.append(frame.f_code.co_filename)

    model = linear()
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu", precision=precision
    )
    loader = data(n=32)  # 4 iterations
    sys.setprofile(profile)
    try:
        trainer.run(loader, max_epochs=1)
    finally:
        sys.setprofile(None)
    assert len(calls) == entered  # bf16: one autocast per forward; fp32: not even a no-op context


def test_loss_goes_down_and_scheduler_steps():
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = create_lr_scheduler(opt, total_steps=16, warmup_steps=4)
    trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), device="cpu", lr_scheduler=sched, check_every=4)
    losses = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: losses.append(e.state.metrics["train_loss"]))
    trainer.run(data(), max_epochs=4)
    assert losses[-1] < losses[0]
    assert sched.last_epoch == 16 and opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)


class LossModel(nn.Module):
    """A model whose forward returns its own loss, as in many notebooks."""

    def __init__(self):
        super().__init__()
        self.net = linear()

    def forward(self, x, y=None):
        logits = self.net(x)
        return logits if y is None else nn.functional.cross_entropy(logits, y)


def test_loss_computed_in_forward():
    a, b = LossModel(), linear()
    fit(b, data())
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    create_trainer(a, opt, None, device="cpu").run(data(), max_epochs=1)
    for pa, pb in zip(a.net.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)


def test_forward_returning_a_vector_is_named():
    class Bad(LossModel):
        def forward(self, x, y=None):
            return super().forward(x).sum(1)

    model = Bad()
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, device="cpu")
    with pytest.raises(TypeError, match=r"0-dim tensor.*shape \(8,\)"):
        trainer.run(data(), max_epochs=1)


def fake_data_parallel(n_devices):
    dp = nn.DataParallel.__new__(nn.DataParallel)
    nn.Module.__init__(dp)
    dp.device_ids = list(range(n_devices))
    return dp


@pytest.mark.parametrize("batch, n_devices", [(10, 4), (7, 3), (5, 4), (8, 2)])
def test_uneven_replica_losses_reduce_to_the_batch_loss(batch, n_devices):
    g = torch.Generator().manual_seed(batch)
    logits, y = torch.randn(batch, 5, generator=g), torch.randint(0, 5, (batch,), generator=g)
    # What DataParallel returns: one mean loss per replica, chunked as its scatter chunks (10 on 4 -> 3/3/3/1).
    per_replica = torch.stack(
        [
            nn.functional.cross_entropy(lc, yc)
            for lc, yc in zip(logits.chunk(n_devices), y.chunk(n_devices), strict=True)
        ]
    )
    reduced = reduce_replica_losses(per_replica, fake_data_parallel(n_devices), batch)
    torch.testing.assert_close(reduced, nn.functional.cross_entropy(logits, y))
    if batch % n_devices:
        assert not torch.allclose(per_replica.mean(), reduced)  # the plain mean would be wrong here


def test_sampler_epoch_is_set_every_epoch():
    ds = TensorDataset(torch.arange(32).float().view(-1, 1), torch.zeros(32, dtype=torch.long))
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3)
    orders = []
    model = nn.Linear(1, 2)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(), device="cpu")
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: orders.append(list(iter(sampler))))
    trainer.run(DataLoader(ds, batch_size=8, sampler=sampler), max_epochs=3)
    assert sampler.epoch == 2
    assert orders[0] != orders[1] != orders[2]


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


def test_guard_stops_on_signal_after_the_stopping_event(monkeypatch):
    monkeypatch.setattr(handlers, "_stop_signal", 0)
    model = linear()
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu", check_every=3
    )
    stopping = []
    trainer.add_event_handler(GuardEvents.STOPPING, lambda e: stopping.append(e.state.iteration))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda: handlers.request_stop(signal.SIGTERM))
    with pytest.raises(TrainingInterrupted, match="SIGTERM at iteration 3") as err:
        trainer.run(data(n=80), max_epochs=1)
    assert err.value.exit_code == 143 and stopping == [3]


def guard_checks(monkeypatch, guard, step_seconds, n, epochs):
    """Iterations at which ``guard`` ran a check, on a clock that advances ``step_seconds`` per iteration."""
    from ignite.engine import Engine

    clock = [0.0]
    monkeypatch.setattr(handlers.time, "perf_counter", lambda: clock[0])

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
    guard = handlers.TrainingGuard(period=0.625, sync_every=20)
    assert guard_checks(monkeypatch, guard, 0.0625, n=25, epochs=2) == [1, 11, 20, 25, 35, 40, 50]


def test_guard_interval_adapts_and_respects_the_accumulation_window(monkeypatch):
    slow = handlers.TrainingGuard(period=0.625)  # 1 s steps: every step
    assert guard_checks(monkeypatch, slow, 1.0, n=5, epochs=1) == [1, 2, 3, 4, 5]
    fast = handlers.TrainingGuard(period=100.0)  # about 1600 steps per period: capped at MAX_INTERVAL
    assert guard_checks(monkeypatch, fast, 0.0625, n=2500, epochs=1) == [1, 1001, 2001, 2500]
    windows = handlers.TrainingGuard(period=0.625, multiple_of=4)  # 10 steps, rounded up to a multiple of 4
    assert guard_checks(monkeypatch, windows, 0.0625, n=40, epochs=1) == [4, 16, 28, 40]
    fixed = handlers.TrainingGuard(every=6, sync_every=4)
    assert guard_checks(monkeypatch, fixed, 0.0625, n=13, epochs=1) == [4, 6, 8, 12, 13]


def test_guard_restarts_its_schedule_when_the_engine_runs_again():
    from ignite.engine import Engine

    guard = handlers.TrainingGuard(every=6)
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
    handlers.TrainingGuard(every=2).attach(trainer)
    with pytest.raises(TrainingDiverged, match=r"\(the loss sum overflowed\); every rank stopped at iteration 2"):
        trainer.run(range(4), max_epochs=1)


def test_evaluator_metrics_and_unwrap():
    from ignite.metrics import Accuracy

    model = linear()
    state = create_evaluator(model, {"acc": Accuracy()}, device="cpu").run(data())
    loader = data()
    x, y = next(iter(DataLoader(loader.dataset, batch_size=32)))
    assert state.metrics["acc"] == pytest.approx((model(x).argmax(1) == y).float().mean().item())
    assert unwrap(nn.DataParallel(model)) is model


def test_dataparallel_gathers_replica_losses_without_the_scalar_warning(monkeypatch, recwarn):
    from ignite_mgpu.handlers import LossDataParallel

    received = []

    def base_gather(self, outputs, output_device):  # stands in for the CUDA gather; torch warns on 0-dim inputs
        received.extend(outputs)
        if all(o.dim() == 0 for o in outputs):
            import warnings

            warnings.warn("Was asked to gather along dimension 0, but all input tensors were scalars", stacklevel=1)
        return torch.cat(outputs)

    monkeypatch.setattr(nn.DataParallel, "gather", base_gather)
    dp = LossDataParallel.__new__(LossDataParallel)
    out = dp.gather([torch.tensor(1.0), torch.tensor(2.0)], output_device=0)
    assert out.shape == (2,) and all(t.dim() == 1 for t in received)
    assert not [w for w in recwarn if "all input tensors were scalars" in str(w.message)]


def test_prepare_model_compiles_and_checkpoints_stay_clean():
    from ignite_mgpu import prepare_model

    net = linear()
    compiled = prepare_model(net, compile=True)  # one process on a CPU: no DDP wrapper
    assert compiled is not net and unwrap(compiled) is net
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    with pytest.raises(ValueError, match="strategy='dp'.*needs CUDA"):
        prepare_model(linear(), strategy="dp")


def test_training_mode_is_restored_after_evaluation():
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 3))
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu")
    evaluator = create_evaluator(model, {}, device="cpu")
    modes = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(data()))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda: modes.append(model[1].training))
    trainer.run(data(), max_epochs=2)
    assert all(modes) and len(modes) == 8
