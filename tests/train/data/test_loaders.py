"""The loaders: the validation sampler gives every sample to one process, loader workers per process (auto).
`python -m pytest tests/train/data/test_loaders.py`."""

import pytest
import torch

from ignite_mgpu.config.schema import DataConfig
from ignite_mgpu.train.data import loaders
from ignite_mgpu.train.data.loaders import UnpaddedDistributedSampler, auto_num_workers


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
    with caplog.at_level("INFO", logger="ignite_mgpu.train.data.loaders"):
        train, val = loaders.create_dataloaders(cfg, 2, 0)
    assert train.num_workers == val.num_workers == 2 and train.persistent_workers and not train.pin_memory
    assert "data.num_workers=auto: 2 loader worker(s) per process (3 CPU(s) of its own, 1 intra-op thread(s))" in (
        caplog.text
    )
    fixed = loaders.create_dataloaders(DataConfig(name="fake", image_size=8, train_size=16, batch_size=8), 2, 0)[0]
    assert fixed.num_workers == 0 and not fixed.persistent_workers


@pytest.mark.parametrize("n, world, batch, drop_last", [(101, 2, 10, False), (101, 4, 8, False), (100, 3, 7, True)])
def test_every_rank_knows_the_most_validation_batches_without_asking(n, world, batch, drop_last):
    """FSDP's evaluation runs as many forwards on every rank: for the validation sampler each rank computes the most
    batches any rank holds (the count a MAX all-reduce would give); a loader of the user's falls back to asking."""
    from torch.utils.data import DataLoader, TensorDataset

    from ignite_mgpu.train.data.loaders import most_batches

    ds = TensorDataset(torch.arange(n))
    loaders_ = [
        DataLoader(ds, batch, sampler=UnpaddedDistributedSampler(ds, world, r, shuffle=False), drop_last=drop_last)
        for r in range(world)
    ]
    most = max(len(loader) for loader in loaders_)
    assert [most_batches(loader, len(loader)) for loader in loaders_] == [most] * world
    assert most_batches(loaders_[-1], 2) is None  # an epoch_length of its own: not a whole pass
    assert most_batches(DataLoader(ds, batch), len(ds)) is None and most_batches([1, 2], 2) is None
