"""Model names: built-in, torchvision, and package.module:factory. `python -m pytest tests/train/test_models.py`."""

import pytest
import torch

from ignite_mgpu.config.schema import ModelConfig
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train.models import SimpleCNN, create_model


def test_names():
    assert isinstance(create_model(ModelConfig()), SimpleCNN)
    assert create_model(ModelConfig(name="resnet18", num_classes=7)).fc.out_features == 7
    factory = create_model(ModelConfig(name="torch.nn:Identity"))
    assert isinstance(factory, torch.nn.Identity)
    x = torch.randn(2, 3, 32, 32)
    assert create_model(ModelConfig(num_classes=4))(x).shape == (2, 4)


@pytest.mark.parametrize("name, match", [("resnet181", "Did you mean 'resnet18'"), ("nope.mod:make", "cannot import")])
def test_unknown_names(name, match):
    with pytest.raises(ConfigError, match=match):
        create_model(ModelConfig(name=name))


@pytest.mark.parametrize("side", [8, 16, 9, 12])
def test_simple_cnn_pools_like_adaptive_pooling_without_its_nondeterministic_cuda_backward(side):
    import torch.nn.functional as F

    from ignite_mgpu.train.models import pool_to

    x = torch.randn(2, 32, side, side)
    torch.testing.assert_close(pool_to(x, 4), F.adaptive_avg_pool2d(x, 4))  # bitwise when the sides divide by 4
    model = SimpleCNN()
    assert not any(isinstance(m, torch.nn.AdaptiveAvgPool2d) for m in model.modules())
    assert list(model.state_dict()) == [
        "features.0.weight",
        "features.0.bias",
        "features.3.weight",
        "features.3.bias",
        "classifier.weight",
        "classifier.bias",
    ]  # old files load
