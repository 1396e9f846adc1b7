"""The distributed data loaders, built over ``idist.auto_dataloader``: ``create_dataloader`` (public) and the default
job's ``create_dataloaders``. The batch is the global batch, training samples are shuffled with the job's seed,
validation gives every sample to exactly one process; the default job's training loader times its own waits.
ignite is imported inside functions: the launching process imports this module's neighbours."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sized
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ignite_mgpu.config.schema import DataConfig
from ignite_mgpu.cpus.affinity import cpu_share
from ignite_mgpu.train.data.datasets import (
    GENERATED,
    build_datasets,
    check_global_batch,
    check_sizes,
    collate_skipping_none,
)
from ignite_mgpu.train.data.sampler import GlobalBatchSampler

if TYPE_CHECKING:
    from ignite.engine import Engine

logger = logging.getLogger(__name__)


class TimedDataLoader(DataLoader):
    """A DataLoader that adds up the seconds spent waiting for its batches (``wait_seconds``, over all passes).

    The epoch log's ``data_wait_share`` reads it. Timing the fetch inside the loader costs less per iteration than
    two event handlers around it (``benchmarks/`` counts both in instructions). ``timed(loader)`` makes one of a
    loader that ``idist.auto_dataloader`` built.
    """

    @property
    def wait_seconds(self) -> float:
        return self.__dict__.get("_waited", [0.0])[0]

    # A generator; ignite only calls next() on it.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A list, not a float attribute: DataLoader.__setattr__ is Python code, this runs for every batch.
        waited = self.__dict__.setdefault("_waited", [0.0])
        batches = super().__iter__()
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            waited[0] += time.perf_counter() - start
            yield batch


def timed(loader: DataLoader) -> TimedDataLoader:
    """``loader`` itself, counting its wait from now on (its class becomes ``TimedDataLoader``: idist.auto_dataloader
    builds a plain DataLoader, and rebuilding one from its attributes differs between torch versions)."""
    loader.__class__ = TimedDataLoader
    return loader  # type: ignore[return-value]  # the class was just changed


class UnpaddedDistributedSampler(DistributedSampler):
    """Validation sampler: every sample exactly once over all ranks (rank r takes r, r+W, ...), no padding.

    ``DistributedSampler`` pads with duplicates so every rank gets the same count; for evaluation that would
    count the padded samples twice in the all-reduced metrics. Ranks may get one sample less; evaluation
    runs no collective per iteration, so the uneven count cannot hang (under FSDP, whose forward is one, the
    evaluator pads the shorter ranks with unscored forwards: ``evaluator.attach_even_forwards``).
    """

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, _length(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, _length(self.dataset), self.num_replicas))


def _length(dataset: Any) -> int:
    """A map-style dataset's length: a sampler's dataset has one, though torch's ``Dataset`` type does not say so."""
    return len(dataset)


def most_batches(loader: Any, epoch_length: int | None) -> int | None:
    """The most batches any rank holds, where this rank can tell without a collective: a whole pass of a
    ``DataLoader`` over the validation sampler (``UnpaddedDistributedSampler``), where rank 0 holds the most
    samples; None for any other loader."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(loader, DataLoader) or not isinstance(sampler, UnpaddedDistributedSampler):
        return None
    if loader.batch_size is None or epoch_length != len(loader):
        return None
    first = len(range(0, _length(sampler.dataset), sampler.num_replicas))
    return first // loader.batch_size if loader.drop_last else -(-first // loader.batch_size)


def auto_num_workers(name: str, share: int, threads: int, cuda: bool) -> int:
    """``data.num_workers=auto`` for one process: the CPUs of its share that its training leaves to loader workers.

    On CUDA the training process needs about one CPU (it mostly waits for the GPU), so the loaders get the rest of
    the share; on the CPU its ``threads`` intra-op threads compute on the share, so the loaders get only what they
    leave (0 when binding gave the process one thread per CPU; with SMT, the sibling hyper-threads). Synthetic
    data is already in memory: no worker.
    """
    if name == "synthetic":
        return 0
    return max(0, share - (1 if cuda else threads))


def create_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    train: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **kwargs: Any,
) -> DataLoader:
    """This process's loader of a map-style ``dataset``, with the CLI's semantics. Call it in every process.

    ``batch_size`` is the global batch, whatever the number of processes M: each process loads its share of it
    (``batch_size / M``, or uneven shares when M does not divide it: 64 over 3 is 22 + 21 + 21). With ``train=True``
    the sampler is a ``GlobalBatchSampler`` (a ``DistributedSampler``) shuffled with ``seed``: the same samples form
    the same global batch on any M, so a run resumed on another process count goes on with the same data order;
    ``create_trainer`` sets its epoch at every epoch start, resumes its position in a resumed epoch and weights
    uneven shares (in a loop of your own: ``loader.sampler.set_epoch``, and scale each rank's mean loss by
    ``loader.sampler.weights()[k]`` for batch k when ``loader.sampler.even`` is False). ``drop_last=True`` drops the
    epoch's short last global batch. With ``train=False`` every sample goes to exactly one process, unpadded, so
    metrics reduced over the processes equal a one-process evaluation. ``num_workers`` are per node, split over its
    processes; other keyword arguments reach ``DataLoader``.

    Raises:
        ConfigError: ``batch_size`` is smaller than the number of processes, or ``dataset`` is empty.
    """
    import ignite.distributed as idist

    world_size, rank = idist.get_world_size(), idist.get_rank()
    sampler: DistributedSampler
    if train:
        check_sizes(dataset, dataset, batch_size, world_size, key="batch_size")
        # Of whole global batches: the same on every rank.
        drop_last = bool(kwargs.pop("drop_last", False))
        sized = cast(Sized, dataset)  # map-style: check_sizes took its length
        global_batches = GlobalBatchSampler(
            sized, world_size, rank, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler, per_process = global_batches, global_batches.loader_batch
    else:
        check_global_batch(batch_size, world_size, key="batch_size")
        sampler = UnpaddedDistributedSampler(dataset, world_size, rank, shuffle=False)
        per_process = max(1, batch_size // world_size)
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    kwargs.setdefault("pin_memory", "cuda" in idist.device().type)
    kwargs.setdefault("persistent_workers", num_workers > 0)
    # idist.auto_dataloader divides the batch (and the node's workers) by the processes: given this process's share
    # times the processes, it divides back to the share exactly.
    batch_size = per_process * world_size
    loader = idist.auto_dataloader(dataset, sampler=sampler, batch_size=batch_size, num_workers=num_workers, **kwargs)
    # A DataLoader: the XLA loader is only built on TPUs.
    return loader  # type: ignore[return-value]


def create_dataloaders(cfg: DataConfig, num_classes: int, seed: int) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders of the default job for this rank (``create_dataloader`` on the config's
    datasets); ``cfg.batch_size`` is the global batch, the same data on 1 and N processes."""
    # Here, not at the top: the launching process imports this module.
    import ignite.distributed as idist

    # torchvision datasets write caches on first use; generated data (synthetic, fake) is built in parallel.
    first = contextlib.nullcontext() if cfg.name in GENERATED else idist.one_rank_first(local=True)
    with first:
        train_ds, val_ds, collate_fn = build_datasets(cfg, num_classes, seed)
    check_sizes(train_ds, val_ds, cfg.batch_size, idist.get_world_size())
    if isinstance(cfg.num_workers, int):
        workers = cfg.num_workers
    # auto: per process; loader workers inherit the process's CPU binding (fork keeps the affinity mask)
    else:
        cuda = "cuda" in idist.device().type
        local = idist.get_nproc_per_node()
        share, threads = cpu_share(local), torch.get_num_threads()
        mine = auto_num_workers(cfg.name, share, threads, cuda)
        logger.info(
            "data.num_workers=auto: %d loader worker(s) per process (%d CPU(s) of its own, %d intra-op thread(s)%s)",
            mine,
            share,
            threads,
            ", CUDA" if cuda else ", synthetic data in memory" if cfg.name == "synthetic" else "",
        )
        # Per node: idist.auto_dataloader divides by the local processes again.
        workers = mine * local
    if collate_fn is None and cfg.skip_bad_samples:
        collate_fn = collate_skipping_none
    common: dict[str, Any] = {"num_workers": workers, "collate_fn": collate_fn}
    train_loader = create_dataloader(train_ds, cfg.batch_size, train=True, shuffle=cfg.shuffle, seed=seed, **common)
    val_loader = create_dataloader(val_ds, cfg.batch_size, train=False, **common)
    return timed(train_loader), val_loader


def attach_skip_counter(trainer: Engine) -> None:
    """Count the unreadable images skipped in each epoch over all ranks (the collate function reports them)."""
    import ignite.distributed as idist
    from ignite.engine import Events

    skipped = [0]

    def count(engine: Engine) -> None:
        # The skip collate adds a 3rd entry.
        skipped[0] += int(engine.state.batch[2])  # type: ignore[index]

    def log_skipped(engine: Engine) -> None:
        total = int(idist.all_reduce(torch.tensor(skipped[0])))
        skipped[0] = 0
        if total:
            logger.warning(
                "epoch %d: skipped %d unreadable images (data.skip_bad_samples=true)", engine.state.epoch, total
            )

    trainer.add_event_handler(Events.ITERATION_COMPLETED, count)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, log_skipped)
