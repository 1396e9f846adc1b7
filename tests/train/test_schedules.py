"""The learning-rate schedule in one process: cosine and constant as they were, torch.optim.lr_scheduler classes and
factories with the arguments the run fills, after the linear warm-up, stepped once per optimizer step taken
(accumulation windows, fp16's skipped steps), saved and restored exactly; what is refused.
`python -m pytest tests/train/test_schedules.py -q`."""

import io
import math

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as torch_schedules

from ignite_mgpu import load_config
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import default_job
from ignite_mgpu.train.optim import check_optim, create_lr_scheduler, create_optimizer, optim_options
from ignite_mgpu.train.step.trainer import create_trainer
from tests.helpers import data, linear

PKG = "tests.plugins_pkg.optim_factories"


def sgd(lr=0.05):
    return torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=lr, momentum=0.9)


def lrs_of(optimizer, schedule, n):
    """The learning rate of each of ``n`` optimizer steps, the schedule stepped after each, as the trainer does."""
    seen = []
    for _ in range(n):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


def test_cosine_and_constant_are_the_warm_up_formula_as_before():
    for name, shape in (("cosine", lambda p: 0.5 * (1.0 + math.cos(math.pi * p))), ("constant", lambda p: 1.0)):
        opt = sgd()
        default = create_lr_scheduler(opt, total_steps=10, warmup_steps=2, cosine=name == "cosine")
        expected = [0.05 * ((k + 1) / 2 if k < 2 else shape(min(1.0, (k - 2) / 8))) for k in range(10)]
        assert lrs_of(opt, default, 10) == expected
        opt = sgd()
        assert lrs_of(opt, create_lr_scheduler(opt, 10, 2, scheduler=name), 10) == expected
        assert isinstance(default, torch_schedules.LambdaLR)  # its state in the checkpoint is as it was


S = torch_schedules
CLASSES = [
    ("StepLR", {"step_size": 2, "gamma": 0.5}, lambda o, n: S.StepLR(o, step_size=2, gamma=0.5)),
    ("MultiStepLR", {"milestones": [1, 3]}, lambda o, n: S.MultiStepLR(o, milestones=[1, 3])),
    ("ExponentialLR", {"gamma": 0.9}, lambda o, n: S.ExponentialLR(o, gamma=0.9)),
    ("PolynomialLR", {}, lambda o, n: S.PolynomialLR(o, total_iters=n)),  # filled: the steps after the warm-up
    ("PolynomialLR", {"total_iters": 3, "power": 2.0}, lambda o, n: S.PolynomialLR(o, total_iters=3, power=2.0)),
    ("CosineAnnealingLR", {"eta_min": 0.001}, lambda o, n: S.CosineAnnealingLR(o, T_max=n, eta_min=0.001)),
    ("OneCycleLR", {}, lambda o, n: S.OneCycleLR(o, max_lr=0.05, total_steps=n)),  # max_lr: optim.lr
    (
        "OneCycleLR",
        {"epochs": 2, "steps_per_epoch": 4, "max_lr": 0.1, "anneal_strategy": "linear"},
        lambda o, n: S.OneCycleLR(o, max_lr=0.1, epochs=2, steps_per_epoch=4, anneal_strategy="linear"),
    ),
    ("LinearLR", {"start_factor": 0.5, "total_iters": 3}, lambda o, n: S.LinearLR(o, start_factor=0.5, total_iters=3)),
    ("ConstantLR", {"factor": 0.5, "total_iters": 2}, lambda o, n: S.ConstantLR(o, factor=0.5, total_iters=2)),
    ("CosineAnnealingWarmRestarts", {"T_0": 3}, lambda o, n: S.CosineAnnealingWarmRestarts(o, T_0=3)),
    (f"{PKG}:halving", {"every": 3}, lambda o, n: S.StepLR(o, step_size=3, gamma=0.5)),
]


@pytest.mark.parametrize("warmup", [0, 2])
@pytest.mark.parametrize("name, args, torch_itself", CLASSES, ids=[f"{c[0]}-{len(c[1])}" for c in CLASSES])
def test_each_schedule_after_the_warm_up_is_torchs_own(name, args, torch_itself, warmup):
    check_optim(
        load_config(
            overrides=[f"optim.scheduler={name}", *(f"optim.scheduler_args.{k}={v}" for k, v in args.items())]
        ).optim
    )
    opt = sgd()
    mine = create_lr_scheduler(opt, total_steps=8 + warmup, warmup_steps=warmup, scheduler=name, scheduler_args=args)
    reference = sgd()
    expected = [0.05 * (k + 1) / warmup for k in range(warmup)] + lrs_of(reference, torch_itself(reference, 8), 8)
    assert lrs_of(opt, mine, 8 + warmup) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert isinstance(mine, torch_schedules.SequentialLR if warmup else torch_schedules.LRScheduler)
    if name.endswith(":halving"):
        assert (mine._schedulers[1] if warmup else mine).total == 8  # a factory taking total_steps is told them


def test_one_cycle_after_the_warm_up_with_accumulation_is_the_hand_computed_sequence():
    """10 micro-batches an epoch in windows of 3: 4 optimizer steps (3, 3, 3 and a short 1), 8 in 2 epochs; a warm-up
    of half an epoch is 2 of them, OneCycleLR the other 6. Each step's learning rate and Adam's beta1 (which
    OneCycleLR cycles) are recorded as the optimizer steps."""
    overrides = ["optim.name=Adam", "optim.lr=0.01", "optim.scheduler=OneCycleLR", "optim.warmup_epochs=0.5"]
    cfg = load_config(overrides=[*overrides, "train.grad_accum_steps=3", "train.epochs=2"])
    model, loader = linear(), data(n=40, batch=4)
    optimizer = create_optimizer(model, **optim_options(cfg.optim))
    schedule = default_job._create_lr_scheduler(cfg, optimizer, len(loader))
    seen = []
    optimizer.register_step_pre_hook(
        lambda o, *_: seen.append((o.param_groups[0]["lr"], o.param_groups[0]["betas"][0]))
    )
    trainer = create_trainer(
        model, optimizer, nn.CrossEntropyLoss(), device="cpu", grad_accum_steps=3, lr_scheduler=schedule
    )
    trainer.run(loader, max_epochs=2)

    # By hand: the warm-up climbs to optim.lr in 2 steps, at OneCycleLR's first beta1 (its constructor sets
    # max_momentum, 0.95); then a fresh torch OneCycleLR of max_lr = optim.lr over the 6 steps left starts at
    # max_lr / 25.
    reference = torch.optim.Adam(nn.Linear(2, 1).parameters(), lr=0.01)
    one_cycle = torch_schedules.OneCycleLR(reference, max_lr=0.01, total_steps=6)
    expected = [(0.005, 0.95), (0.01, 0.95)]
    for _ in range(6):
        expected.append((reference.param_groups[0]["lr"], reference.param_groups[0]["betas"][0]))
        reference.step()
        one_cycle.step()
    assert seen == expected
    assert seen[2] == (pytest.approx(0.01 / 25), pytest.approx(0.95)) and seen[-1][0] < 1e-5
    assert trainer.state.iteration == 20 and schedule.last_epoch == 8  # stepped once per optimizer step


def test_a_skipped_fp16_step_does_not_advance_a_sequential_schedule(monkeypatch):
    from ignite_mgpu.train.step import trainer

    monkeypatch.setattr(trainer, "FP16_DEVICE_TYPES", ("cuda", "cpu"))  # GradScaler works on the CPU too
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = create_lr_scheduler(opt, 8, 2, scheduler="OneCycleLR")
    trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), device="cpu", precision="fp16", lr_scheduler=schedule)
    model.weight.register_hook(lambda g: g * float("inf") if trainer.state.iteration in (1, 2) else g)
    trainer.run(data(n=32), max_epochs=1)
    assert schedule.last_epoch == 2  # 4 iterations, 2 optimizer steps taken: the warm-up is over, no more
    after_two = sgd(0.1)
    lrs_of(after_two, create_lr_scheduler(after_two, 8, 2, scheduler="OneCycleLR"), 2)
    assert opt.param_groups[0]["lr"] == after_two.param_groups[0]["lr"] == pytest.approx(0.1 / 25)


def test_the_state_of_warm_up_and_one_cycle_resumes_exactly():
    def built():
        opt = sgd()
        return opt, create_lr_scheduler(opt, 10, 3, scheduler="OneCycleLR", scheduler_args={"pct_start": 0.5})

    opt, schedule = built()
    straight = lrs_of(opt, schedule, 10)
    opt, schedule = built()
    first = lrs_of(opt, schedule, 4)  # past the warm-up: both schedules' states matter
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "lr_scheduler": schedule.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # as checkpoints are read
    opt, schedule = built()
    opt.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["lr_scheduler"])
    assert first + lrs_of(opt, schedule, 6) == straight


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["optim.scheduler=OneCycle"],
            r"^optim.scheduler=OneCycle is not known. Did you mean OneCycleLR\? Use cosine, constant, a class of "
            r"torch.optim.lr_scheduler by its name, any case \(ConstantLR, .*StepLR\), or 'package.module:factory' for "
            r"your own.$",
        ),
        (
            ["optim.scheduler=ReduceLROnPlateau"],
            r"optim.scheduler=ReduceLROnPlateau is not supported: it steps on a validation metric",
        ),
        (
            ["optim.scheduler=LambdaLR"],
            r"not supported: it takes a Python function, which YAML cannot hold: build it in a",
        ),
        (["optim.scheduler=SequentialLR"], r"not supported: it takes other schedulers"),
        (
            ["optim.scheduler=StepLR"],
            r"optim.scheduler=StepLR needs step_size, which optim.scheduler_args does not give",
        ),
        (
            ["optim.scheduler=StepLR", "optim.scheduler_args.step=3"],
            r"optim.scheduler_args gives step, which optim.scheduler=StepLR does not accept",
        ),
        ([f"optim.scheduler={PKG}:nothing"], rf"module '{PKG}' has no attribute 'nothing'"),
    ],
)
def test_schedule_mistakes_are_found_before_anything_starts(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_optim(load_config(overrides=overrides).optim)


@pytest.mark.parametrize(
    "name, args, match",
    [
        (f"{PKG}:plateau", {}, rf"optim.scheduler={PKG}:plateau returned a ReduceLROnPlateau; a scheduler factory"),
        ("OneCycleLR", {"pct_start": 2.0}, r"optim.scheduler=OneCycleLR: calling it raised ValueError: Expected float"),
    ],
)
def test_what_only_building_finds_is_a_config_error_too(name, args, match):
    with pytest.raises(ConfigError, match=match):
        create_lr_scheduler(sgd(), 10, 2, scheduler=name, scheduler_args=args)


def test_a_job_resumed_after_the_warm_up_ends_as_the_straight_one_and_keeps_its_length(tmp_path, monkeypatch):
    """configs/adam_onecycle.yaml (the how-to's) with a warm-up of half an epoch before OneCycleLR, in this process:
    resumed from its first epoch's checkpoint (past the warm-up), it ends bitwise as the run that went straight on.
    Its schedule's length is the run's: another train.epochs is another run."""
    from ignite_mgpu.checkpoint.files import read_checkpoint
    from ignite_mgpu.errors import CheckpointError
    from tests.conftest import REPO

    monkeypatch.setattr(default_job, "setup_logging", lambda rank: None)  # leave pytest's logging alone
    small = ["model.name=mlp", "data.image_size=8", "data.train_size=128", "train.epochs=3", "checkpoint.n_saved=5"]
    small += ["optim.warmup_epochs=0.5", "train.progress_bar=false", "train.keep_cpu_memory=false", "train.loggers=[]"]

    def run(out, *extra):
        default_job.training(
            0, load_config(REPO / "configs/adam_onecycle.yaml", [*small, f"output_dir={tmp_path / out}", *extra])
        )
        return read_checkpoint(tmp_path / out / "checkpoint_12.pt")  # 4 iterations an epoch

    straight = run("straight")
    resumed = run("resumed", f"resume={tmp_path / 'straight' / 'checkpoint_4.pt'}")
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for index, state in straight["optimizer"]["state"].items():
        assert all(torch.equal(v, resumed["optimizer"]["state"][index][k]) for k, v in state.items())
    assert straight["lr_scheduler"] == resumed["lr_scheduler"]
    assert [s["last_epoch"] for s in straight["lr_scheduler"]["_schedulers"]] == [1, 10]  # warm-up 2, OneCycleLR 10
    with pytest.raises(CheckpointError, match=r"train.epochs: 3 -> 4\) \(optim.scheduler=OneCycleLR was built for"):
        run("longer", "train.epochs=4", f"resume={tmp_path / 'straight' / 'checkpoint_4.pt'}")
