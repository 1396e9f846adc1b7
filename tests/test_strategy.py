"""How a model is wrapped: DataParallel's per-replica losses reduced exactly and gathered without the scalar
warning, torch.compile's wrapper, unwrap. `python -m pytest tests/test_strategy.py`."""

import pytest
import torch
from torch import nn

from ignite_mgpu.strategy import LossDataParallel, prepare_model, reduce_replica_losses, unwrap
from tests.helpers import linear


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


def test_dataparallel_gathers_replica_losses_without_the_scalar_warning(monkeypatch, recwarn):
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
    net = linear()
    compiled = prepare_model(net, compile=True)  # one process on a CPU: no DDP wrapper
    assert compiled is not net and unwrap(compiled) is net
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    with pytest.raises(ValueError, match="strategy='dp'.*needs CUDA"):
        prepare_model(linear(), strategy="dp")
