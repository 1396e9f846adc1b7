"""Batches of every shape and what models return: moved to the device, split into inputs and targets, the loss
found in an output. `python -m pytest tests/train/data/test_batches.py`."""

from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train.data import batches


def test_every_tensor_moves_nested_ones_too_and_the_rest_stays():
    Pair = namedtuple("Pair", "x y")
    batch = {"x": torch.ones(2), "meta": {"ids": [torch.zeros(2), "a"]}, "pair": Pair(torch.ones(1), 3), "name": "b"}
    moved = batches.to_device(batch, torch.device("meta"))
    assert moved["x"].is_meta and moved["meta"]["ids"][0].is_meta and moved["meta"]["ids"][1] == "a"
    assert isinstance(moved["pair"], Pair) and moved["pair"].x.is_meta and moved["pair"].y == 3
    assert moved["name"] == "b" and batches.size(moved) == 2


def test_a_tensor_already_on_the_device_is_kept_as_it_is():
    x, y = torch.ones(2), torch.zeros(2, dtype=torch.long)
    moved = batches.to_device([x, y], torch.device("cpu"), non_blocking=True)
    assert moved[0] is x and moved[1] is y and isinstance(moved, list)
    assert batches.to_device((x,), torch.device("meta"))[0].is_meta  # another device: moved


def test_split_a_sequence_or_a_mapping():
    x, y = torch.ones(4, 2), torch.zeros(4)
    assert batches.split((x, y, "extra"))[1] is y
    inputs, targets = batches.split({"input_ids": x, "labels": y})
    assert targets is y and list(inputs) == ["input_ids"]
    assert batches.split({"x": x, "targets": y})[1] is y
    with pytest.raises(TypeError, match=r"no labels or targets \(its keys: x\).*train.loss=model"):
        batches.split({"x": x})


def test_the_loss_and_the_predictions_in_what_a_model_returns():
    loss, logits = torch.tensor(1.5), torch.ones(2, 3)
    for output in (loss, {"loss": loss, "logits": logits}, SimpleNamespace(loss=loss, logits=logits)):
        assert batches.loss_of(output) is loss
    for output in (logits, {"logits": logits}, SimpleNamespace(logits=logits)):
        assert batches.logits(output) is logits
    with pytest.raises(TypeError, match="returned a dict without one"):
        batches.loss_of({"logits": logits})
    with pytest.raises(TypeError, match="must return the predictions"):
        batches.logits(SimpleNamespace(loss=loss))


def test_a_batch_the_loss_cannot_use_is_a_config_error():
    batches.check({"x": torch.ones(2)}, "model")  # the model takes **batch and computes its loss
    batches.check((torch.ones(2), torch.zeros(2)), "cross_entropy")
    with pytest.raises(ConfigError, match=r"train.loss=cross_entropy needs the targets, .* without labels or targets"):
        batches.check({"x": torch.ones(2)}, "cross_entropy")
    with pytest.raises(
        ConfigError, match=r"batches are a Tensor, but train.loss=cross_entropy needs \(inputs, targets\)"
    ):
        batches.check(torch.ones(2, 3), "cross_entropy")
    with pytest.raises(ConfigError, match="holds no tensor"):
        batches.check(["a", "b"], "model")
