"""Writing checkpoints: ignite's ``Checkpoint`` handlers over a saver that never deletes the previous file before the
new one is safely on disk; the full training state on a schedule and on a stop (one file, or a sharded folder), the
best unwrapped model after validation."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, global_step_from_engine
from torch import nn

from ignite_mgpu.checkpoint.background import AsyncDiskSaver, stager_available
from ignite_mgpu.checkpoint.disk import SafeDiskSaver as SafeDiskSaver  # where it was
from ignite_mgpu.checkpoint.files import (
    BEST_NAME,
    CKPT_NAME,
    SAFETENSORS,
    list_checkpoints,
)
from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint
from ignite_mgpu.checkpoint.state import FullModelState, module_and_optimizer
from ignite_mgpu.checkpoint.weights import SOURCE, TiedWeights, model_metadata
from ignite_mgpu.config.schema import CheckpointConfig
from ignite_mgpu.errors import CheckpointError
from ignite_mgpu.processes import stop
from ignite_mgpu.runs import metric_names
from ignite_mgpu.train.guard import GuardEvents
from ignite_mgpu.train.strategy import unwrap

logger = logging.getLogger(__name__)


class RunInfo:
    """Saved with every checkpoint: what a resume must know about the run that wrote it."""

    def __init__(self, world_size: int, global_batch: int, config: dict[str, str]) -> None:
        self.info = {"world_size": world_size, "global_batch": global_batch, "config": config}
        self.loaded: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.info)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = dict(state)


class LowerIsBetter(float):
    """A loss (any metric where lower is better) as the best model's score. ignite keeps the highest score, so the
    value is the negated loss; the file name shows the loss as reported (``best_model_2_val_loss=2.4889.pt``, not
    ``-2.4889``)."""

    def __format__(self, spec: str) -> str:
        return format(-float(self), spec)


def best_score(metric: str, value: float, mode: str = "auto") -> float:
    """The score ignite ranks best models by (higher is better) for ``metric``'s ``value``, as reported or as a
    file name holds it (old names hold a loss negated: the sign is ignored); ``mode``: checkpoint.metric_mode."""
    score = metric_names.ranked(metric, value, mode)
    return score if metric_names.higher_is_better(metric, mode) else LowerIsBetter(score)


def create_checkpointers(
    objects: Mapping[str, Any],
    model: nn.Module,
    dirname: str | Path,
    n_saved: int,
    metric: str,
    best_step: Callable[[Any, Any], int],
    mode: str = "auto",
    best_format: str = "pt",
    async_save: bool = False,
) -> tuple[Checkpoint, Checkpoint]:
    """(full training state ``checkpoint_<iteration>.pt``, best unwrapped model ``best_model_*.pt``, or with
    ``best_format="safetensors"`` ``best_model_*.safetensors``: each tie written once, the model's settings from
    ``objects["run"]`` as its metadata). ``async_save``: the full state is written in the background
    (``AsyncDiskSaver``); the best model always synchronously (``fit`` returns its file right after training)."""
    saver = SafeDiskSaver(dirname, _best_metadata(objects, metric))
    full_saver = AsyncDiskSaver(dirname, idist.device().type) if async_save else saver
    full = Checkpoint(dict(objects), full_saver, n_saved=n_saved, global_step_transform=lambda e, _: e.state.iteration)
    safetensors, weights = best_format == "safetensors", cast(Any, model)
    if safetensors:  # a wrapper's (DataParallel's) state_dict would carry its prefix: ignite unwraps only its own
        unwrapped = model if isinstance(model, FullModelState) else unwrap(model)
        weights = TiedWeights(unwrapped, module_and_optimizer(unwrapped, None)[0])
    best = Checkpoint(
        {"model": weights},
        saver,
        filename_prefix="best",
        n_saved=1,
        score_function=lambda e: best_score(metric, e.state.metrics[metric], mode),
        score_name=f"val_{metric}",
        global_step_transform=best_step,
    )
    if safetensors:
        best.ext = SAFETENSORS[1:]  # ignite's Checkpoint names its files {...}.{ext}
    return full, best


def _best_metadata(objects: Mapping[str, Any], metric: str) -> dict[str, str]:
    """A safetensors best model's metadata: where it comes from, the run's model settings."""
    run = objects.get("run")
    config = run.info["config"] if isinstance(run, RunInfo) else {}
    return {SOURCE: f"the best model by val_{metric}", **model_metadata(cast(Mapping[str, str], config))}


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


def finish_writes(full: Checkpoint | ShardedCheckpoint) -> None:
    """Wait for ``full``'s background write, if any (``checkpoint.async_save``), raising its error."""
    target = full if isinstance(full, ShardedCheckpoint) else full.save_handler
    if isinstance(target, (AsyncDiskSaver, ShardedCheckpoint)):
        target.finish()


@contextlib.contextmanager
def writes_awaited(full: Checkpoint | ShardedCheckpoint) -> Iterator[None]:
    """Around ``trainer.run``: the last background write is awaited before the job goes on, and its error raised;
    after another error it is awaited too, its own error only logged (the first error is the job's)."""
    try:
        yield
    except BaseException:
        try:
            finish_writes(full)
        except CheckpointError as err:
            logger.error("%s", err)
        raise
    finish_writes(full)


def adopt_existing(
    full: Checkpoint | ShardedCheckpoint, best: Checkpoint, dirname: str | Path, mode: str = "auto"
) -> None:
    """On resume, let the handlers manage the files the interrupted run left (keep n_saved, one best, ranked with
    checkpoint.metric_mode ``mode``); sharded folders need nothing: their handler counts the folders on disk."""
    if isinstance(full, Checkpoint):
        files = [p for p in list_checkpoints(dirname) if p.is_file()]
        found = [(int(m.group(1)), p.name) for p in files if (m := CKPT_NAME.match(p.name))]
        full.load_state_dict({"_saved": sorted(found)})
    bests = [
        (best_score(m.group(2), float(m.group(3)), mode), p.name)
        for p in Path(dirname).glob("best_model_*")  # .pt and .safetensors: best_format may change on resume
        if (m := BEST_NAME.match(p.name))
    ]
    best.load_state_dict({"_saved": sorted(bests)})
