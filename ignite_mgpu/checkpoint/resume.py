"""Resuming a run: restoring every object from a checkpoint after checking that it belongs to the same run
(``same_run.py``: the run signature saved in every checkpoint, the checkpoint to resume)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ignite.distributed as idist

from ignite_mgpu.checkpoint.files import is_safetensors
from ignite_mgpu.checkpoint.load import load_checkpoint
from ignite_mgpu.checkpoint.same_run import resume_target, same_run_check
from ignite_mgpu.checkpoint.sharded import load_sharded
from ignite_mgpu.config.schema import Config
from ignite_mgpu.runs.folder import run_dir

logger = logging.getLogger("ignite_mgpu")


def resume(cfg: Config, to_save: dict[str, Any], world_size: int) -> bool:
    """Restore every object from ``cfg.resume`` (a file or a sharded folder, or "auto": the newest complete one;
    when there is none yet, nothing is restored and a new run starts, with a warning). A ``.safetensors`` file
    holds weights only: the model is loaded and the rest starts fresh (``continue_from_weights``).

    Returns False when the checkpoint already finished ``train.epochs`` (nothing left to train).
    """
    path = resume_target(cfg)
    if path is not None and is_safetensors(path):
        continue_from_weights(path, to_save)
        return True
    if path is None:
        if idist.get_rank() == 0:
            logger.warning(
                "--resume auto: no complete checkpoint in %s yet: starting a new run", run_dir(cfg.output_dir).resolve()
            )
        return True
    same_run = same_run_check(cfg, path)
    if path.is_dir():  # checkpoint.format=sharded: resharded for this process count as it is read
        load_sharded(path, to_save, check=same_run)
    else:
        # Read onto the CPU: a sharded model's full checkpoint stays there (each rank copies only its shards to its
        # GPU), and every load_state_dict places its own tensors.
        load_checkpoint(path, to_save, check=same_run)
    saved = to_save["run"].loaded
    logger.info("resumed from %s at iteration %d", path, to_save["trainer"].state.iteration)
    if saved.get("world_size", world_size) != world_size and idist.get_rank() == 0:
        shares = [len(range(r, cfg.data.batch_size, world_size)) for r in range(world_size)]
        logger.warning(
            "checkpoint was written with %d processes, resuming with %d: the same run goes on (the global batch stays "
            "%d, now %s per process; the epoch's data order and position are kept)",
            saved["world_size"],
            world_size,
            cfg.data.batch_size,
            " + ".join(map(str, shares)),
        )
    state = to_save["trainer"].state
    if state.epoch >= cfg.train.epochs and state.iteration % state.epoch_length == 0:
        if idist.get_rank() != 0:  # every rank stops; one says why
            return False
        logger.warning(
            "%s already finished %d epochs (train.epochs=%d): nothing to train; raise train.epochs to "
            "continue training",
            path,
            state.epoch,
            cfg.train.epochs,
        )
        return False
    return True


def continue_from_weights(path: Path, to_save: dict[str, Any]) -> None:
    """A new run from the weights of ``path``: the model is loaded (keys and shapes checked first); the optimizer,
    the learning-rate schedule and the trainer start fresh, at epoch 0. Not an exact resume, and said so."""
    load_checkpoint(path, {"model": to_save["model"]})  # onto the CPU, as resume
    if idist.get_rank() == 0:
        logger.warning(
            "--resume %s: weights only: the model starts from this file's weights; the optimizer, the learning-rate "
            "schedule and the epoch count start fresh (epoch 0): a .safetensors file holds no training state. To "
            "continue a run exactly, resume from its checkpoint_<iteration>.pt (or --resume auto)",
            path,
        )
