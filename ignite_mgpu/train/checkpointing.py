"""The checkpoint handlers on the trainer: the full state on a schedule (through the guard's ``CHECKPOINT`` event)
and on a stop, the best model after validation, each marked as saving for the supervisor."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, global_step_from_engine

from ignite_mgpu.checkpoint.background import stager_available
from ignite_mgpu.checkpoint.save import create_checkpointers, finish_writes
from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint
from ignite_mgpu.config.schema import CheckpointConfig
from ignite_mgpu.env import stop
from ignite_mgpu.train.step.guard import GuardEvents

logger = logging.getLogger(__name__)


def attach_checkpoints(
    trainer: Engine,
    evaluator: Engine,
    to_save: dict[str, Any],
    cfg: CheckpointConfig,
    output_dir: str | Path,
    metric: str,
) -> tuple[Checkpoint | ShardedCheckpoint, Checkpoint]:
    """Full state every N epochs, iterations or minutes and on a stop signal (``checkpoint_<iteration>.pt``, or a
    sharded ``checkpoint_<iteration>/`` folder with ``checkpoint.format=sharded``); the best unwrapped model by
    ``metric`` after validation, always one plain file (``checkpoint.best_format``: a state_dict, or safetensors).

    Periodic saves go through ``GuardEvents.CHECKPOINT``: the guard fires it for every_iters and every_minutes (at
    the same iteration on every rank, at the end of an accumulation window, never after an unchecked NaN, and at
    an epoch's end only after its other handlers), and this module at the end of every ``every``-th epoch, after
    validation and the epoch log: a checkpoint of a finished epoch always has that epoch recorded.
    """
    full: Checkpoint | ShardedCheckpoint
    in_background = _in_background(cfg.async_save)
    full, best = create_checkpointers(
        to_save,
        to_save["model"],
        output_dir,
        cfg.n_saved,
        metric,
        global_step_from_engine(trainer),
        cfg.metric_mode,
        cfg.best_format,
        in_background and cfg.format == "full",
    )
    if cfg.format == "sharded":
        full = ShardedCheckpoint(to_save, output_dir, cfg.n_saved, in_background)
    trainer.add_event_handler(GuardEvents.CHECKPOINT, _while_saving(full, trainer))
    if cfg.every:
        trainer.add_event_handler(
            Events.EPOCH_COMPLETED(every=cfg.every), lambda engine: engine.fire_event(GuardEvents.CHECKPOINT)
        )
    if cfg.save_on_stop:  # the stop's checkpoint is awaited: the process exits next
        trainer.add_event_handler(GuardEvents.STOPPING, _while_saving(full, trainer, wait=True))
    evaluator.add_event_handler(Events.COMPLETED, _while_saving(best, trainer))
    return full, best


def _in_background(async_save: bool) -> bool:
    """``checkpoint.async_save`` (the default) where this PyTorch can take the snapshot (2.9 or newer); on an older
    one the job saves synchronously, as before, and rank 0 says so once, rather than failing a job that did not ask."""
    if async_save and not stager_available():
        if idist.get_rank() == 0:
            logger.warning(
                "checkpoint.async_save: PyTorch %s cannot snapshot a checkpoint for a background write (2.9 or newer "
                "can); checkpoints are written synchronously",
                torch.__version__,
            )
        return False
    return async_save


def _while_saving(
    handler: Checkpoint | ShardedCheckpoint, trainer: Engine, wait: bool = False
) -> Callable[[Engine], None]:
    """``handler`` marked as saving for the supervisor: after another rank's failure it lets this save land. The
    training thread's time in it is added to ``trainer.state.checkpoint_stall`` (seconds, since the run's start;
    ``checkpoint_saves`` counts the saves). ``wait``: a background write is awaited too."""

    def save(engine: Engine) -> None:
        start = time.perf_counter()
        with stop.saving():
            handler(engine)
            if wait:
                finish_writes(handler)
        state = cast(Any, trainer.state)  # ignite's State takes new attributes
        state.checkpoint_stall = getattr(state, "checkpoint_stall", 0.0) + time.perf_counter() - start
        state.checkpoint_saves = getattr(state, "checkpoint_saves", 0) + 1

    return save
