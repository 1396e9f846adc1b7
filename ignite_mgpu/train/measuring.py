"""``measuring(local_rank, cfg, iterations)``: what every process of ``ignite-mgpu scale`` runs at one size. The
default job's own step (``default_job.build``: its data, model, strategy, optimizer, precision, accumulation and
micro-batches), two epochs of ``iterations`` each, the first a warm-up; no validation, no checkpoint, no tracker.
Rank 0 returns the second epoch's line as ``metrics.jsonl`` has it (``EpochLog``): samples/s, the time per
iteration and each rank's step split."""

from __future__ import annotations

import logging
from typing import Any

import ignite.distributed as idist

from ignite_mgpu.config.schema import Config
from ignite_mgpu.parallel.strategy import model_devices
from ignite_mgpu.runs import folder
from ignite_mgpu.train.allocator import frozen_heap
from ignite_mgpu.train.default_job import build, start_process
from ignite_mgpu.train.epoch_log import EpochLog

# The epochs of a size: a warm-up (allocations, cuDNN's choice, the first all-reduce's set-up, torch.compile), then
# the one measured.
EPOCHS = 2


def measuring(local_rank: int, cfg: Config, iterations: int) -> dict[str, Any] | None:
    """Train ``cfg``'s step for ``EPOCHS`` epochs of ``iterations`` in this process; rank 0 returns the measured
    epoch's line (None on the other ranks). ``cfg.output_dir``: a folder of the scale command's own, removed by it."""
    rank, world_size = idist.get_rank(), idist.get_world_size()
    logging.getLogger("ignite_mgpu").setLevel(logging.WARNING)  # the scale command prints the table; warnings stay
    out = start_process(cfg, rank, world_size)
    built = build(cfg, out)
    epoch_log = EpochLog(out / folder.METRICS, cfg.data.batch_size, None, model_devices(built.model))
    epoch_log.attach(built.trainer)
    with frozen_heap():  # as a worker forked from the fork server: the 1-process size runs in this process
        built.trainer.run(built.train_loader, max_epochs=EPOCHS, epoch_length=iterations)
    return epoch_log.last if rank == 0 else None
