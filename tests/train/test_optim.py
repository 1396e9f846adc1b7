"""The default job's optimizer: optim.nesterov switches SGD's Nesterov momentum (on by default); AdamW ignores it.
`python -m pytest tests/train/test_optim.py -q`."""

import pytest
import torch

from ignite_mgpu import load_config
from ignite_mgpu.train.optim import create_optimizer


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
