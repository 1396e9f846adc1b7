"""GlobalBatchSampler in one process, every rank built by hand: the same samples in the same global batch on any
process count, each sample once per epoch across a change of the count mid-epoch, DistributedSampler's own indices
where the count divides, weights that make DDP's average the global batch's mean.
`python -m pytest tests/train/data/test_sampler.py`."""

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ignite_mgpu.train.data.sampler import GlobalBatchSampler


def loaders(size: int, batch: int, world: int, epoch: int = 0, **kwargs) -> list[DataLoader]:
    """Every rank's loader of ``range(size)``, as create_dataloader builds them."""
    made = []
    for rank in range(world):
        sampler = GlobalBatchSampler(range(size), world, rank, batch, seed=3, **kwargs)
        sampler.set_epoch(epoch)
        made.append(DataLoader(range(size), batch_size=sampler.loader_batch, sampler=sampler))
    return made


def global_batches(size: int, batch: int, world: int, start: int = 0, epoch: int = 0) -> list[list[int]]:
    """The global batches the ranks serve from ``start`` on, the 0-weighted repeats left out."""
    ranks = loaders(size, batch, world, epoch)
    for loader in ranks:
        loader.sampler.set_start(start)
    served = [list(loader) for loader in ranks]
    assert len({len(s) for s in served}) == 1  # every rank runs as many steps: DDP's collectives match
    weights = [loader.sampler.weights()[start:] for loader in ranks]
    return [
        sorted(i for r in range(world) if weights[r][k] > 0 for i in served[r][k].tolist())
        for k in range(len(served[0]))
    ]


@pytest.mark.parametrize("size, batch", [(256, 64), (250, 64), (67, 10), (7, 4)])
def test_a_global_batch_holds_the_same_samples_on_any_process_count(size, batch):
    reference = global_batches(size, batch, 1)
    assert sorted(i for b in reference for i in b) == list(range(size))  # each sample once per epoch
    for world in (2, 3, 4):
        assert global_batches(size, batch, world) == reference, world


@pytest.mark.parametrize("size, batch", [(256, 64), (250, 64), (67, 10)])
def test_each_sample_is_served_once_across_a_change_of_the_process_count_mid_epoch(size, batch):
    whole = global_batches(size, batch, 1)
    for before in (1, 2, 3):
        for after in (1, 2, 3, 4):
            for stop in range(1, len(whole)):
                first = global_batches(size, batch, before)[:stop]
                rest = global_batches(size, batch, after, start=stop)
                assert first + rest == whole, (before, after, stop)
    assert global_batches(size, batch, 2, epoch=1) != global_batches(size, batch, 2)  # set_epoch reshuffles


def test_the_indices_are_distributed_samplers_where_the_count_divides():
    for world in (1, 2, 4):
        for rank in range(world):
            ours = GlobalBatchSampler(range(256), world, rank, 64, seed=5)
            theirs = DistributedSampler(range(256), world, rank, seed=5)  # type: ignore[arg-type]
            ours.set_epoch(2)
            theirs.set_epoch(2)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
            assert ours.even and ours.weights() == [1.0] * 4


def test_uneven_shares_weigh_each_ranks_mean_into_the_global_mean():
    values = torch.randn(250, dtype=torch.float64)
    for world in (2, 3, 4):
        ranks = loaders(250, 64, world)
        assert [r.sampler.loader_batch for r in ranks][:3] == [64 // world + (64 % world > i) for i in range(3)][:world]
        assert len({len(r) for r in ranks}) == 1 == len({len(list(r)) for r in ranks})
        for k, parts in enumerate(zip(*(list(r) for r in ranks), strict=True)):
            # DDP averages the ranks' gradients: the weighted means average to the global batch's mean.
            averaged = sum(r.sampler.weights()[k] * values[p].mean() for r, p in zip(ranks, parts, strict=True)) / world
            served = torch.cat([p for r, p in zip(ranks, parts, strict=True) if r.sampler.weights()[k] > 0])
            assert averaged.item() == pytest.approx(values[served].mean().item(), rel=1e-12)
    assert not loaders(256, 64, 3)[0].sampler.even and loaders(256, 64, 2)[0].sampler.even
    assert not loaders(250, 64, 4)[0].sampler.even  # 250 = 3 * 64 + 58: the last batch splits unevenly


def test_the_largest_share_of_every_batch_is_known_to_every_rank():
    # What micro-batches under FSDP pad to (issue #50): 150 in batches of 64 over 3 is 22 + 21 + 21, then 8 + 7 + 7.
    for world in (2, 3, 4):
        ranks = loaders(150, 64, world)
        served = [[len(b) for b in r] for r in ranks]
        assert all(r.sampler.largest() == [max(sizes) for sizes in zip(*served, strict=True)] for r in ranks)
    assert loaders(150, 64, 3)[2].sampler.largest() == [22, 22, 8]


def test_a_rank_without_a_sample_of_the_last_batch_repeats_one_weighted_zero():
    # 7 samples in batches of 4 over 3 ranks: the last global batch holds 3, the last rank's share of it 1; over 4
    # ranks, the fourth rank's share of it is empty.
    ranks = loaders(7, 4, 4)
    last = [list(r)[-1].tolist() for r in ranks]
    assert [len(batch) for batch in last] == [1, 1, 1, 1]
    assert [r.sampler.weights()[-1] for r in ranks] == [4 / 3, 4 / 3, 4 / 3, 0.0]
    assert last[3][0] in last[0]  # the repeat is a sample of that batch, counted 0 times


def test_drop_last_drops_the_short_global_batch_on_every_rank():
    ranks = loaders(250, 64, 3, drop_last=True)
    assert [len(r) for r in ranks] == [3, 3, 3] and all(r.sampler.even is False for r in ranks)
    assert sorted(i for r in ranks for b in r for i in b.tolist()) == sorted(
        i for b in global_batches(250, 64, 1)[:3] for i in b
    )
