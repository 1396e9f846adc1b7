"""The default job's optimizer in one process: optim.name (sgd, adamw, torch.optim classes, factories) with optim.args,
what is refused, and the parameter groups (optim.no_decay_norm_and_bias, optim.param_groups) on plain, DataParallel,
DDP and FSDP2 models (one-rank gloo groups). `python -m pytest tests/train/test_optim.py -q`."""

import logging

import pytest
import torch
from torch import nn

from ignite_mgpu import load_config
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train.optim import check_optim, create_optimizer, optim_options
from tests.helpers import cpu_fsdp

PKG = "tests.plugins_pkg.optim_factories"


def build(model, *overrides):
    """What the default job builds for these overrides, after the pre-flight's check (the job's own wiring)."""
    cfg = load_config(overrides=list(overrides))
    check_optim(cfg.optim)
    return create_optimizer(model, **optim_options(cfg.optim))


def twins(seed=0):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    b = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    b.load_state_dict(a.state_dict())
    return a, b


def steps(model, opt, n=3):
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize(
    "overrides, nesterov",
    [([], True), (["optim.nesterov=false"], False), (["optim.momentum=0"], False)],  # Nesterov needs momentum
)
def test_sgd_is_nesterov_unless_switched_off(overrides, nesterov):
    o = load_config(overrides=overrides).optim
    optimizer = create_optimizer(torch.nn.Linear(2, 2), o.name, o.lr, o.momentum, o.weight_decay, o.nesterov)
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["nesterov"] is nesterov
    assert optimizer.param_groups[0]["momentum"] == o.momentum


def test_plain_momentum_sgd_steps_as_torch_sgd():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    b.load_state_dict(a.state_dict())
    mine = create_optimizer(a, "sgd", 0.1, 0.9, 0.0, nesterov=False)
    plain = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 3)
    for _ in range(3):
        for model, opt in ((a, mine), (b, plain)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert torch.equal(a.weight, b.weight)


OPT = torch.optim


@pytest.mark.parametrize(
    "overrides, torch_itself",
    [
        ([], lambda p: OPT.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)),  # the default
        (["optim.name=adamw"], lambda p: OPT.AdamW(p, lr=0.05, weight_decay=5e-4)),
        (
            ["optim.name=Adam", "optim.args.betas=[0.8,0.9]", "optim.args.eps=1e-6", "optim.lr=0.01"],
            # betas as YAML gives them (a list): PyTorch 2.4 keeps them so in param_groups, newer ones make a tuple
            lambda p: OPT.Adam(p, lr=0.01, betas=[0.8, 0.9], eps=1e-6, weight_decay=5e-4),
        ),
        (["optim.name=RMSprop"], lambda p: OPT.RMSprop(p, lr=0.05, momentum=0.9, weight_decay=5e-4)),  # has momentum
        (
            ["optim.name=Adagrad", "optim.args.lr_decay=0.1"],
            lambda p: OPT.Adagrad(p, lr=0.05, lr_decay=0.1, weight_decay=5e-4),
        ),
        (["optim.name=NAdam", "optim.weight_decay=0"], lambda p: OPT.NAdam(p, lr=0.05)),
        (
            ["optim.name=SGD", "optim.args.dampening=0.1"],
            lambda p: OPT.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=5e-4),
        ),
        (["optim.name=Rprop", "optim.weight_decay=0"], lambda p: OPT.Rprop(p, lr=0.05)),  # takes no weight_decay
        # Any case: a torch.optim class (adam: Adam, rmsprop: RMSprop), a built-in (Sgd: sgd's Nesterov momentum).
        (["optim.name=adam"], lambda p: OPT.Adam(p, lr=0.05, weight_decay=5e-4)),
        (["optim.name=rmsprop"], lambda p: OPT.RMSprop(p, lr=0.05, momentum=0.9, weight_decay=5e-4)),
        (["optim.name=ADAMW"], lambda p: OPT.AdamW(p, lr=0.05, weight_decay=5e-4)),
        (["optim.name=Sgd"], lambda p: OPT.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)),
        (["optim.name=SGD"], lambda p: OPT.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4)),  # torch's, classic
    ],
)
def test_each_name_is_the_torch_class_with_lr_weight_decay_momentum_and_args(overrides, torch_itself):
    a, b = twins()
    mine, theirs = build(a, *overrides), torch_itself(b.parameters())
    assert type(mine) is type(theirs)
    assert {k: v for k, v in mine.param_groups[0].items() if k != "params"} == {
        k: v for k, v in theirs.param_groups[0].items() if k != "params"
    }
    steps(a, mine)
    steps(b, theirs)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_a_factory_gets_the_groups_lr_weight_decay_and_args():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    opt = build(model, f"optim.name={PKG}:adam_with_trust", "optim.args.trust=0.5", "optim.no_decay_norm_and_bias=true")
    assert isinstance(opt, torch.optim.Adam) and opt.trust == 0.5
    assert [(len(g["params"]), g["lr"], g["weight_decay"]) for g in opt.param_groups] == [
        (2, 0.025, 5e-4),
        (2, 0.025, 0.0),
    ]
    assert isinstance(build(model, f"optim.name={PKG}:no_weight_decay", "optim.weight_decay=0"), torch.optim.SGD)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["optim.name=adma"],
            r"^optim.name=adma is not known. Did you mean Adamax, Adam or RAdam\? Use sgd, adamw, a class of "
            r"torch.optim by its name, any case \(ASGD, .*Adam, AdamW,.*\), or 'package.module:factory' for your "
            r"own.$",
        ),
        (["optim.name=OneCycleLR"], r"optim.name=OneCycleLR is not known. Use sgd, adamw"),
        (["optim.name=LBFGS"], r"optim.name=LBFGS is not supported: its step\(\) needs a closure"),
        (
            ["optim.args.lr=0.1"],
            r"optim.args.lr=0.1 gives what optim.lr gives every optimizer: set optim.lr=0.1 and remove optim.args.lr",
        ),
        (["optim.name=RMSprop", "optim.args.momentum=0"], r"optim.args.momentum=0 gives what optim.momentum gives"),
        (["optim.args.weight_decay=0"], r"set optim.weight_decay=0 and remove optim.args.weight_decay"),
        (["optim.args.nesterov=false"], r"optim.args.nesterov with optim.name=sgd: set optim.nesterov instead"),
        (
            ["optim.name=Rprop"],
            r"optim.name=Rprop takes no weight_decay, but optim.weight_decay=0.0005: set optim.weight_decay=0",
        ),
        (
            ["optim.name=Adam", "optim.args.beta=0.9"],
            r"optim.args gives beta, which optim.name=Adam does not accept \(it takes: .*betas",
        ),
        ([f"optim.name={PKG}:no_weight_decay"], rf"optim.name={PKG}:no_weight_decay takes no weight_decay"),
        ([f"optim.name={PKG}:missing"], rf"optim.name={PKG}:missing: module '{PKG}' has no attribute 'missing'"),
        ([f"optim.param_groups={PKG}.nothing:groups"], rf"optim.param_groups={PKG}.nothing:groups: cannot import"),
    ],
)
def test_mistakes_are_one_paragraph_before_anything_starts(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_optim(load_config(overrides=overrides).optim)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ([f"optim.name={PKG}:not_an_optimizer"], r"returned a list, not a torch.optim.Optimizer"),
        (
            ["optim.name=Adam", "optim.args.betas=[1.5,0.9]"],
            r"optim.name=Adam: calling it raised ValueError: Invalid beta",
        ),
        ([f"optim.param_groups={PKG}:foreign"], r"group 0 holds a tensor that is not a parameter of the model"),
        ([f"optim.param_groups={PKG}:twice"], r"a parameter is in two groups \(again in group 1\)"),
    ],
)
def test_what_only_building_finds_is_a_config_error_too(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)), *overrides)


class LlamaRMSNorm(nn.Module):
    """Hugging Face's own norm classes subclass nn.Module, not torch's norms: their 1-d weight is what counts."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


class Everything(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)
        self.embed, self.ln = nn.Embedding(5, 4), nn.LayerNorm((2, 4))  # a 2-d LayerNorm weight: a norm all the same
        self.gn, self.rms, self.hf = nn.GroupNorm(1, 4), nn.RMSNorm(4), LlamaRMSNorm(4)
        self.fc, self.frozen = nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_no_decay_takes_biases_norms_and_every_one_dimensional_parameter():
    model = Everything()
    opt = build(model, "optim.no_decay_norm_and_bias=true", "optim.weight_decay=0.1")
    names = {id(p): n for n, p in model.named_parameters()}
    assert [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in opt.param_groups] == [
        (["conv.weight", "embed.weight", "fc.weight"], 0.1),
        (
            ["conv.bias", "bn.weight", "bn.bias", "ln.weight", "ln.bias", "gn.weight", "gn.bias", "rms.weight"]
            + ["hf.weight", "fc.bias"],
            0.0,
        ),
    ]  # the frozen layer in neither: as without groups, only trainable parameters reach the optimizer


@pytest.mark.usefixtures("one_rank")
def test_groups_hold_what_the_wrapper_trains_under_dataparallel_and_ddp():
    from torch.nn.parallel import DistributedDataParallel

    for wrapped in (
        nn.DataParallel(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))),
        DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))),
    ):
        opt = build(wrapped, "optim.no_decay_norm_and_bias=true")
        assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
        assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in wrapped.parameters()}
        heads = build(wrapped, f"optim.param_groups={PKG}:heads_faster")  # the factory gets the user's module
        assert [(len(g["params"]), g["lr"]) for g in heads.param_groups] == [(2, 0.05), (2, 0.5)]
        steps(wrapped, heads, n=1)


@cpu_fsdp
@pytest.mark.usefixtures("one_rank")
def test_groups_of_an_fsdp2_model_are_its_sharded_parameters():
    from ignite_mgpu.parallel.fsdp import fully_shard  # torch.distributed.fsdp on torch >= 2.6

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    for module in (model[0], model[2], model):  # as fsdp.shard_model does on several ranks
        fully_shard(module)
    opt = build(model, "optim.name=AdamW", "optim.no_decay_norm_and_bias=true")
    (decay, no_decay) = opt.param_groups
    assert all(type(p).__name__ == "DTensor" for p in decay["params"] + no_decay["params"])  # sharded
    assert [tuple(p.shape) for p in decay["params"]] == [(4, 3), (1, 4)]  # the full shapes, not the shards'
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 4
    assert {id(p) for p in decay["params"] + no_decay["params"]} == {id(p) for p in model.parameters()}
    steps(model, opt, n=1)
    from ignite_mgpu.checkpoint.state import FullOptimizerState

    saved = FullOptimizerState(model, opt).state_dict()  # what checkpoint_*.pt holds: indices over both groups
    assert [(g["params"], g["weight_decay"]) for g in saved["param_groups"]] == [([0, 1], 5e-4), ([2, 3, 4, 5], 0.0)]


def test_factory_groups_a_generator_and_a_partial_answer(caplog):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    assert len(build(model, f"optim.param_groups={PKG}:only_parameters").param_groups[0]["params"]) == 4
    with caplog.at_level(logging.WARNING, logger="ignite_mgpu"):
        opt = build(model, f"optim.param_groups={PKG}:first_layer_only")
    assert len(opt.param_groups) == 1 and "leaves 2 trainable parameters out of every group: not trained" in caplog.text


def test_a_schedule_is_named_in_any_case_too():
    from ignite_mgpu.train.optim import scheduler_factory

    assert scheduler_factory("onecyclelr") is torch.optim.lr_scheduler.OneCycleLR
    assert scheduler_factory("StepLR") is torch.optim.lr_scheduler.StepLR
