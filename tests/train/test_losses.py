"""train.loss with train.loss_args in one process: cross-entropy's label smoothing, class weights and ignored index,
a factory's arguments, and what is refused. `python -m pytest tests/train/test_losses.py -q`."""

import pytest
import torch
from torch import nn

from ignite_mgpu import load_config
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train.losses import check_loss, create_loss

PKG = "tests.plugins_pkg.optim_factories"


def loss_of(*overrides):
    t = load_config(overrides=list(overrides)).train
    check_loss(t.loss, t.loss_args)
    return create_loss(t.loss, t.loss_args, device="cpu")


def test_cross_entropy_takes_label_smoothing_class_weights_and_an_ignored_index():
    logits = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([0, 1, 2, -1, 1, 0])
    mine = loss_of(
        "train.loss_args.label_smoothing=0.1", "train.loss_args.weight=[1,2,0.5]", "train.loss_args.ignore_index=-1"
    )
    torch_itself = nn.CrossEntropyLoss(label_smoothing=0.1, weight=torch.tensor([1.0, 2.0, 0.5]), ignore_index=-1)
    assert isinstance(mine, nn.CrossEntropyLoss) and torch.equal(mine(logits, targets), torch_itself(logits, targets))
    assert mine.weight.dtype == torch.float32
    assert torch.equal(loss_of()(logits, targets.clamp(min=0)), nn.CrossEntropyLoss()(logits, targets.clamp(min=0)))


def test_class_weights_are_on_the_default_device_when_none_is_given():
    assert create_loss("cross_entropy", {"weight": [1.0, 2.0]}).weight.device.type == "cpu"  # idist.device() here


def test_a_factory_gets_its_arguments():
    assert loss_of(f"train.loss={PKG}:focal", "train.loss_args.gamma=3").gamma == 3


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["train.loss_args.reduction=sum"],
            r"train.loss_args gives reduction, which train.loss=cross_entropy does not take \(it takes "
            r"label_smoothing, weight, ignore_index; the reduction is the batch mean, which the trainer needs\)",
        ),
        (["train.loss_args.label_smoothing=1.5"], r"label_smoothing=1.5: use a number from 0 to 1"),
        (["train.loss_args.weight=3"], r"train.loss_args.weight=3: give one weight >= 0 per class, as a list"),
        (["train.loss_args.weight=[1,-2]"], r"train.loss_args.weight=\[1, -2\]: give one weight >= 0 per class"),
        (["train.loss_args.ignore_index=0.5"], r"ignore_index=0.5: use the integer target to ignore"),
        (
            [f"train.loss={PKG}:focal", "train.loss_args.alpha=1"],
            rf"train.loss_args gives alpha, which train.loss={PKG}:focal",
        ),
    ],
)
def test_mistakes_name_the_key_before_anything_starts(overrides, match):
    with pytest.raises(ConfigError, match=match):  # a built-in's arguments with the config, a factory's here
        t = load_config(overrides=overrides).train
        check_loss(t.loss, t.loss_args)


def test_the_models_own_loss_takes_no_arguments():
    with pytest.raises(ConfigError, match=r"train.loss_args is for a loss function, but train.loss=model"):
        create_loss("model", {"label_smoothing": 0.1})
    assert create_loss("model") is None
