"""Model names: built-in, torchvision, and package.module:factory. `python -m pytest tests/test_models.py`."""

import pytest
import torch

from ignite_mgpu.config import ConfigError, ModelConfig
from ignite_mgpu.models import SimpleCNN, create_model


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
