"""The training sampler of any process count: ``GlobalBatchSampler`` serves this rank's share of every global batch
of an epoch whose order depends on the seed and the epoch only, so that a run stopped on N processes goes on, on any
M, with the same samples in the same global steps, each sample once per epoch.

The epoch's order is ``DistributedSampler``'s permutation (``torch.randperm`` seeded with ``seed + epoch``). Global
batch k is the positions ``[k * B, (k + 1) * B)`` of it; rank r takes the offsets ``r, r + M, r + 2M, ...`` of each
(``DistributedSampler``'s own split when M divides the batch and the dataset: then both serve the same indices).
When M does not divide a batch, the shares are uneven (64 over 3: 22 + 21 + 21) and ``weights()`` says by how much
each rank's mean loss counts, so that the gradient DDP averages over the ranks is the mean over the global batch. A
rank whose share of the epoch's short last batch is empty gets one sample of it again, weighted 0, so that every rank
runs the same number of steps (DDP's collectives) and no sample counts twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data.distributed import DistributedSampler


class GlobalBatchSampler(DistributedSampler):
    """This rank's indices of every global batch of ``batch_size`` (``loader_batch`` of them at most per batch: the
    loader's batch size), from global batch ``start`` on (``set_start``: a resumed epoch's position, for the next pass
    only).

    A ``DistributedSampler``: ``set_epoch`` reshuffles (the trainer calls it at every epoch's start).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
        self.batch_size, self.start = batch_size, 0
        size = len(dataset)
        self.batches = size // batch_size if drop_last else math.ceil(size / batch_size)
        last = size - (self.batches - 1) * batch_size
        # The global size of every batch of the epoch: all full, but maybe the last one.
        self.global_sizes = [batch_size] * (self.batches - 1) + [min(last, batch_size)]
        # What the loader batches by: this rank's share of a full batch.
        self.loader_batch = self.share(batch_size)

    def share(self, global_size: int) -> int:
        """How many of a global batch of ``global_size`` this rank serves (0: the batch is smaller than its rank)."""
        return len(range(self.rank, global_size, self.num_replicas))

    @property
    def even(self) -> bool:
        """Whether every rank serves as many samples of every batch: each rank's mean loss then counts the same."""
        return all(size % self.num_replicas == 0 for size in {self.global_sizes[0], self.global_sizes[-1]})

    def weights(self) -> list[float]:
        """Per batch of the epoch, how much this rank's mean loss counts in DDP's average over the ranks for the
        gradient to be the global batch's mean: ``M * share / size`` (1.0 for even shares, 0.0 for an empty one)."""
        return [self.num_replicas * self.share(size) / size for size in self.global_sizes]

    def largest(self) -> list[int]:
        """Per batch of the epoch, the most samples any rank serves of it (rank 0's share): every rank of a model
        whose forwards are collectives runs as many parts of it under ``train.micro_batch``."""
        return [-(-size // self.num_replicas) for size in self.global_sizes]

    def set_start(self, batch: int) -> None:
        """The next pass starts at global batch ``batch`` of the epoch (a resumed epoch); later passes at 0."""
        self.start = batch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))  # type: ignore[arg-type]  # sized
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]  # sized

    def __iter__(self) -> Iterator[int]:
        order, start, self.start = self._order(), self.start, 0
        mine: list[int] = []
        for k in range(start, self.batches):
            first, size = k * self.batch_size, self.global_sizes[k]
            # An empty share of the short last batch: one sample again, weighted 0 (weights()).
            mine += order[first + self.rank : first + size : self.num_replicas] or order[first : first + 1]
        # A list's iterator: the loader takes every index without a Python frame per sample.
        return iter(mine)

    def __len__(self) -> int:
        """A whole epoch's (a resumed pass serves less: ignite counts its iterations from the resumed one)."""
        return sum(max(1, self.share(size)) for size in self.global_sizes)
