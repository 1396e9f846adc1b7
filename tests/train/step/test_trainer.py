"""create_trainer / create_evaluator in one process: accumulation, clipping, precision, loss-in-forward,
sampler epochs, training mode after evaluation. `python -m pytest tests/train/step/test_trainer.py`."""

import contextlib
import copy
import math

import pytest
import torch
from ignite.engine import Events
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.parallel.strategy import unwrap
from ignite_mgpu.train.evaluator import create_evaluator
from ignite_mgpu.train.optim import create_lr_scheduler
from ignite_mgpu.train.step.trainer import create_trainer
from tests.helpers import LossModel, data, linear


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


def test_a_cpu_step_uses_the_batch_as_the_loader_gives_it(monkeypatch):
    """On the CPU the batch is in CPU memory already: the training step does not walk it (a cost on every step); the
    evaluator still moves what it gets."""
    from ignite_mgpu.train.data import batches

    walked = []
    to_device = batches.to_device
    monkeypatch.setattr(batches, "to_device", lambda b, *a, **k: (walked.append(1), to_device(b, *a, **k))[1])
    model = linear()
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu")
    trainer.run(data(n=32), max_epochs=1)
    assert walked == [] and trainer.state.iteration == 4
    create_evaluator(model, {}, device="cpu").run(data(n=16))
    assert walked == [1, 1]


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


def test_evaluator_metrics_and_unwrap():
    from ignite.metrics import Accuracy

    model = linear()
    state = create_evaluator(model, {"acc": Accuracy()}, device="cpu").run(data())
    loader = data()
    x, y = next(iter(DataLoader(loader.dataset, batch_size=32)))
    assert state.metrics["acc"] == pytest.approx((model(x).argmax(1) == y).float().mean().item())
    assert unwrap(nn.DataParallel(model)) is model


def test_training_mode_is_restored_after_evaluation():
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 3))
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu")
    evaluator = create_evaluator(model, {}, device="cpu")
    modes = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(data()))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda: modes.append(model[1].training))
    trainer.run(data(), max_epochs=2)
    assert all(modes) and len(modes) == 8


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """PyTorch's GradScaler works on the CPU too; create_trainer allows fp16 only on CUDA, where it is useful."""
    from ignite_mgpu.train.step import trainer

    monkeypatch.setattr(trainer, "FP16_DEVICE_TYPES", ("cuda", "cpu"))


def test_fp16_a_skipped_optimizer_step_does_not_advance_the_schedule(fp16_on_cpu, recwarn):
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = create_lr_scheduler(opt, total_steps=8, warmup_steps=2)
    trainer = create_trainer(
        model, opt, nn.CrossEntropyLoss(), device="cpu", precision="fp16", lr_scheduler=sched, check_every=1
    )
    overflow = [1, 2]  # the first two steps overflow, as fp16's first steps with a large initial scale do
    # Infinite gradients on those steps: GradScaler finds them and skips optimizer.step().
    model.weight.register_hook(lambda g: g * float("inf") if trainer.state.iteration in overflow else g)

    trainer.run(data(n=32), max_epochs=1)
    assert sched.last_epoch == 4 - len(overflow)  # 4 iterations, 2 optimizer steps taken
    assert not [w for w in recwarn if "lr_scheduler.step()` before `optimizer.step()" in str(w.message)]


def test_an_fp32_checkpoint_resumes_in_fp16(fp16_on_cpu):
    fp32 = create_trainer(linear(), torch.optim.SGD(linear().parameters(), lr=0.1), nn.MSELoss(), device="cpu")
    saved = fp32.step.scaler.state_dict()
    assert saved == {}  # a disabled GradScaler saves nothing
    fp16 = create_trainer(
        linear(), torch.optim.SGD(linear().parameters(), lr=0.1), nn.MSELoss(), device="cpu", precision="fp16"
    )
    fp16.step.scaler.load_state_dict(saved)  # plain GradScaler raises: "The source state dict is empty"
    assert fp16.step.scaler.get_scale() == 65536.0  # its initial scale, kept


def test_the_trainer_holds_its_steps_parts(deterministic_mode_restored):
    import dataclasses

    from ignite.engine import DeterministicEngine, Engine

    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), device="cpu", grad_accum_steps=2, clip_grad_norm=1.0)
    step = trainer.step
    assert isinstance(trainer, Engine) and step.model is model and step.optimizer is opt
    assert (step.grad_accum_steps, step.clip_grad_norm, step.micro_batching) == (2, 1.0, None)
    assert step.parameters == tuple(model.parameters()) and not step.scaler.is_enabled()
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.grad_accum_steps = 1  # built once: the step's closures read it when they are built
    exact = create_trainer(model, opt, nn.CrossEntropyLoss(), device="cpu", deterministic=True, micro_batch=4)
    assert isinstance(exact, DeterministicEngine) and exact.step.micro_batching.size == 4


@pytest.fixture
def deterministic_mode_restored():
    import os

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def test_deterministic_mode_stays_strict_when_ignite_relaxes_it_on_cuda(deterministic_mode_restored, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # ignite's DeterministicEngine then sets warn_only
    model = linear()
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu", deterministic=True
    )
    modes = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda: modes.append(
            (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        ),
    )
    trainer.run(data(), max_epochs=1)
    assert set(modes) == {(True, False)}  # strict: an op without a deterministic kernel raises
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_validation_metrics_follow_the_loss_and_accumulate_on_the_training_device():
    from ignite_mgpu.train.evaluator import validation_metrics

    cpu = torch.device("cpu")
    classification = validation_metrics(nn.CrossEntropyLoss(), cpu)
    assert set(classification) == {"accuracy", "loss"} and {m._device for m in classification.values()} == {cpu}
    assert set(validation_metrics(nn.MSELoss(), cpu)) == set(validation_metrics(None, cpu)) == {"loss"}


class HFStyle(nn.Module):
    """Takes keyword inputs, computes its loss when given labels, returns an object with .loss (Hugging Face style)."""

    def __init__(self):
        super().__init__()
        self.net = linear()

    def forward(self, x, labels=None, note=None):
        from types import SimpleNamespace

        logits = self.net(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits)


def mapping_data(n=32, batch=8):
    loader = data(n, batch)
    x, y = loader.dataset.tensors
    items = [{"x": x[i], "labels": y[i], "note": f"sample {i}"} for i in range(n)]
    return DataLoader(items, batch_size=batch)


@pytest.mark.parametrize("kind", ["model loss, object with .loss", "loss function on .logits"])
def test_mapping_batches_train_like_tuple_batches(kind):
    reference, hf = linear(), HFStyle()
    fit(reference, data())
    loss_fn = None if kind.startswith("model") else nn.CrossEntropyLoss()
    create_trainer(hf, torch.optim.SGD(hf.parameters(), lr=0.1), loss_fn, device="cpu").run(mapping_data(), 1)
    for a, b in zip(reference.parameters(), hf.net.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_model_loss_evaluation_is_the_exact_mean_over_samples():
    from ignite_mgpu.train.evaluator import validation_metrics

    model = HFStyle()
    batches_of = mapping_data(n=30, batch=8)  # 8, 8, 8, 6: a plain mean of batch means would be off
    state = create_evaluator(model, validation_metrics(None, torch.device("cpu")), model_loss=True, device="cpu").run(
        batches_of
    )
    x, y = data(30).dataset.tensors
    torch.testing.assert_close(state.metrics["loss"], nn.functional.cross_entropy(model.net(x), y).item())


def test_a_loss_factory_of_the_users():
    from ignite_mgpu.train.step.trainer import create_loss

    assert isinstance(create_loss("cross_entropy"), nn.CrossEntropyLoss) and create_loss("model") is None
    smoothed = create_loss("tests.plugins_pkg.factories:smooth_l1")
    assert smoothed.label_smoothing == 0.1
    model = linear()
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), smoothed, device="cpu")
    trainer.run(data(), max_epochs=1)
    with pytest.raises(ConfigError, match=r"train.loss=tests.plugins_pkg.factories:number returned a int; a loss "):
        create_loss("tests.plugins_pkg.factories:number")


# ----------------------------------------------------------------------------------------------- accumulation windows


def test_the_short_last_window_of_an_epoch_is_the_mean_over_its_own_micro_batches():
    # 40 samples in micro-batches of 4: 10 iterations per epoch, windows of 3 -> 12, 12, 12 and a short 4 samples.
    # Each window's gradient is its samples' mean, the same as one batch of 12, 12, 12 and 4.
    a, b = linear(), linear()
    fit(a, data(n=40, batch=12), epochs=2)
    trainer = fit(b, data(n=40, batch=4), epochs=2, grad_accum_steps=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)
    assert trainer.state.iteration == 20


def test_a_run_resumed_from_an_epoch_end_equals_an_uninterrupted_one_with_accumulation():
    """grad_accum_steps=3 and 10 iterations per epoch: the epoch-end state holds no pending gradients."""

    def run(model, epochs, state=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), device="cpu", grad_accum_steps=3)
        if state is not None:  # what a checkpoint restores
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            trainer.load_state_dict(state["trainer"])
        trainer.run(data(n=40, batch=4), max_epochs=epochs)
        saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": trainer.state_dict()}
        return copy.deepcopy(saved)

    straight = run(linear(), 3)
    resumed = run(linear(seed=5), 3, run(linear(), 1))  # another initialisation: everything comes from the state
    assert resumed["trainer"]["iteration"] == straight["trainer"]["iteration"] == 30
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for k, v in straight["optimizer"]["state"].items():
        assert torch.equal(v["momentum_buffer"], resumed["optimizer"]["state"][k]["momentum_buffer"])


def test_accumulation_skips_the_gradient_sync_inside_a_window_only(monkeypatch):
    # DDP's no_sync is entered on the micro-batches that do not end a window: 1, 2, 4, 5, 7, 8 of an epoch of 10.
    class FakeDDP(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = linear()

        def forward(self, x):
            return self.module(x)

    from ignite_mgpu.parallel import strategy

    model = FakeDDP()
    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append(trainer.state.iteration)
        yield

    model.no_sync = no_sync
    monkeypatch.setattr(strategy, "find_ddp", lambda m: model)  # parallel.strategy.no_sync chooses from it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), device="cpu", grad_accum_steps=3)
    trainer.run(data(n=40, batch=4), max_epochs=2)
    assert entered == [1, 2, 4, 5, 7, 8, 11, 12, 14, 15, 17, 18]


@pytest.mark.parametrize("options", [{}, {"grad_accum_steps": 2}, {"micro_batch": 2}])
def test_uneven_shares_weigh_each_ranks_loss_into_the_global_batchs_mean(options):
    """Three ranks' shares of global batches of 8 (3 + 3 + 2; the short last batch of 6: 2 + 2 + 2), run in one
    process with lr=0: the ranks' weighted losses average to each global batch's mean loss, for both steps."""
    from ignite_mgpu.train.data.sampler import GlobalBatchSampler

    x, y = torch.randn(30, 6, generator=torch.Generator().manual_seed(1)), torch.randint(0, 3, (30,))
    ds, model = TensorDataset(x, y), linear()
    outputs = []
    for rank in range(3):
        sampler = GlobalBatchSampler(ds, 3, rank, 8, seed=2)
        trainer = create_trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(), device="cpu", **options
        )
        seen: list[float] = []
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e, seen=seen: seen.append(e.state.output.item()))
        trainer.run(DataLoader(ds, batch_size=sampler.loader_batch, sampler=sampler), max_epochs=1)
        assert trainer.step.shares.weights == sampler.weights() != [1.0] * 4
        outputs.append(seen)
    sampler.set_epoch(0)
    order = GlobalBatchSampler(ds, 1, 0, 8, seed=2)._order()
    with torch.no_grad():
        for k, ranks in enumerate(zip(*outputs, strict=True)):
            batch = order[8 * k : 8 * k + 8]
            expected = nn.functional.cross_entropy(model(x[batch]), y[batch]).item()
            assert sum(ranks) / 3 == pytest.approx(expected, rel=1e-6), k
