"""The memory plan's estimate against CUDA's own count on a real GPU: the default CNN and a small Linear stack, one
process, two real steps on cuda:0, ``torch.cuda.max_memory_allocated`` against the fake-tensor peak (±15 %).
Run: python -m pytest -m gpu tests/gpu/test_memory_plan_cuda.py (skips without CUDA)."""

from __future__ import annotations

import pytest

from tests.conftest import needs_gpus
from tests.helpers import memory_trackers

pytestmark = [pytest.mark.gpu, memory_trackers]


@pytest.mark.parametrize("overrides", [["data.train_size=512"], ["model.name=mlp", "optim.name=adamw"]])
def test_estimate_is_within_15_percent_of_max_memory_allocated(overrides):
    needs_gpus(1)
    import torch

    from ignite_mgpu.config.loading import load_config
    from ignite_mgpu.memory.estimate import example_batch, measure
    from ignite_mgpu.train.data import batches
    from ignite_mgpu.train.data.datasets import build_datasets, example_inputs, first_batch
    from ignite_mgpu.train.models import create_model
    from ignite_mgpu.train.optim import create_optimizer, optim_options

    cfg = load_config(None, [*overrides, "data.batch_size=512"])
    estimate = measure(cfg, example_batch(cfg), 512, cuda=True).peak  # the foreach optimizer, cuBLAS's workspaces
    splits = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
    example = example_inputs(splits.train, splits.collate_fn)
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    batch = batches.to_device(first_batch(splits.train, splits.collate_fn, 512), device)
    model = create_model(cfg.model, example).to(device)
    optimizer = create_optimizer(model, **optim_options(cfg.optim), distributed=False)
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated(device) - start
    assert abs(estimate - measured) <= 0.15 * measured, (estimate, measured)
