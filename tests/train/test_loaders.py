"""The loaders: the validation sampler gives every sample to one process, loader workers per process (auto).
`python -m pytest tests/train/test_loaders.py`."""

import pytest
import torch

from ignite_mgpu.config.schema import DataConfig
from ignite_mgpu.train import loaders
from ignite_mgpu.train.loaders import UnpaddedDistributedSampler, auto_num_workers


@pytest.mark.parametrize("n, world", [(101, 2), (10, 3), (4, 4), (3, 4)])
def test_validation_sampler_counts_every_sample_once(n, world):
    ds = list(range(n))
    seen = [i for r in range(world) for i in UnpaddedDistributedSampler(ds, world, r, shuffle=False)]
    assert sorted(seen) == ds
    assert sum(len(UnpaddedDistributedSampler(ds, world, r, shuffle=False)) for r in range(world)) == n


@pytest.mark.parametrize(
    "name, share, threads, cuda, expected",
    [
        ("synthetic", 8, 1, True, 0),  # already in memory: nothing to load
        ("imagefolder", 8, 8, True, 7),  # CUDA: the training process counts as one CPU
        ("imagefolder", 8, 8, False, 0),  # CPU: its threads use the whole share
        ("imagefolder", 8, 4, False, 4),
        ("fake", 1, 1, True, 0),
    ],
)
def test_auto_num_workers_hands_out_the_cpus_training_leaves(name, share, threads, cuda, expected):
    assert auto_num_workers(name, share, threads, cuda) == expected


def test_auto_num_workers_reaches_the_loaders(monkeypatch, caplog):
    monkeypatch.setattr(loaders, "cpu_share", lambda local: 3)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cfg = DataConfig(name="fake", num_workers="auto", image_size=8, train_size=16, val_size=8, batch_size=8)
    with caplog.at_level("INFO", logger="ignite_mgpu.train.loaders"):
        train, val = loaders.create_dataloaders(cfg, 2, 0)
    assert train.num_workers == val.num_workers == 2 and train.persistent_workers and not train.pin_memory
    assert "data.num_workers=auto: 2 loader worker(s) per process (3 CPU(s) of its own, 1 intra-op thread(s))" in (
        caplog.text
    )
    fixed = loaders.create_dataloaders(DataConfig(name="fake", image_size=8, train_size=16, batch_size=8), 2, 0)[0]
    assert fixed.num_workers == 0 and not fixed.persistent_workers
