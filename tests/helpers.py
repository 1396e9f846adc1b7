"""Small models and loaders shared by the in-process tests (one process, CPU, a few milliseconds each)."""

import importlib.util

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ignite_mgpu.parallel import fsdp

# FSDP2 over gloo, in one process or two: the product refuses it before PyTorch 2.6 (tests/test_cli.py).
cpu_fsdp = pytest.mark.skipif(
    not fsdp.runs_on_cpu(),
    reason=f"FSDP2 on the CPU needs PyTorch 2.6 or newer (CUDA streams before); this is PyTorch {torch.__version__}",
)
# The memory plan's trackers (torch.distributed._tools): not in PyTorch 2.4, where `ignite-mgpu plan` says to upgrade
# (tests/test_jobs.py) and tests/memory is not collected.
MEMORY_TRACKERS = importlib.util.find_spec("torch.distributed._tools.fsdp2_mem_tracker") is not None
memory_trackers = pytest.mark.skipif(
    not MEMORY_TRACKERS, reason=f"the memory plan's trackers are not in PyTorch {torch.__version__} (2.14 has them)"
)


def data(n=32, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(6, 3)


class LossModel(nn.Module):
    """A model whose forward returns its own loss, as in many notebooks."""

    def __init__(self):
        super().__init__()
        self.net = linear()

    def forward(self, x, y=None):
        logits = self.net(x)
        return logits if y is None else nn.functional.cross_entropy(logits, y)


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def hugging_face():
    """transformers with its PyTorch models, or a skip: recent transformers disables them below PyTorch 2.6."""
    transformers = pytest.importorskip("transformers")
    if not transformers.utils.is_torch_available():
        pytest.skip(
            f"transformers {transformers.__version__} needs PyTorch 2.6 or newer for its models; this is PyTorch "
            f"{torch.__version__}"
        )
    return transformers
