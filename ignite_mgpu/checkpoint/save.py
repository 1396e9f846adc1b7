"""Writing checkpoints: ignite's ``Checkpoint`` handlers over a saver that never deletes the previous file before the
new one is safely on disk; the full training state on a schedule and on a stop (one file, or a sharded folder), the
best unwrapped model after validation."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import ignite.distributed as idist
from ignite.handlers import Checkpoint
from torch import nn

from ignite_mgpu.checkpoint.background import AsyncDiskSaver
from ignite_mgpu.checkpoint.disk import SafeDiskSaver as SafeDiskSaver  # where it was
from ignite_mgpu.checkpoint.files import (
    BEST_NAME,
    CKPT_NAME,
    CORRUPT_SUFFIX,
    SAFETENSORS,
    is_complete,
    list_checkpoints,
)
from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint
from ignite_mgpu.checkpoint.state import FullModelState, module_and_optimizer
from ignite_mgpu.checkpoint.weights import SOURCE, TiedWeights, model_metadata
from ignite_mgpu.errors import CheckpointError
from ignite_mgpu.parallel.strategy import unwrap
from ignite_mgpu.runs import metric_names

logger = logging.getLogger(__name__)


class RunInfo:
    """Saved with every checkpoint: what a resume must know about the run that wrote it."""

    def __init__(
        self,
        world_size: int,
        global_batch: int,
        config: dict[str, str],
        progress: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.info = {"world_size": world_size, "global_batch": global_batch, "config": config}
        # What the run has of its current epoch when a checkpoint is written (the epoch's loss sums).
        self.progress = progress
        self.loaded: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {**self.info, **(self.progress() if self.progress is not None else {})}

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
    # A sharded model's full state is gathered into new CPU tensors at every save: a snapshot already.
    fresh = ("model", "optimizer") if isinstance(objects.get("model"), FullModelState) else ()
    full_saver = AsyncDiskSaver(dirname, idist.device().type, fresh) if async_save else saver
    full = Checkpoint(dict(objects), full_saver, n_saved=n_saved, global_step_transform=lambda e, _: e.state.iteration)
    safetensors, weights = best_format == "safetensors", cast(Any, model)
    # A wrapper's (DataParallel's) state_dict would carry its prefix: ignite unwraps only its own.
    if safetensors:
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
        # Only rank 0 removes files: the others need not read (and CRC-check) every checkpoint again.
        check = _complete_or_set_aside if idist.get_rank() == 0 else lambda p: True
        files = [p for p in list_checkpoints(dirname) if p.is_file() and check(p)]
        found = [(int(m.group(1)), p.name) for p in files if (m := CKPT_NAME.match(p.name))]
        full.load_state_dict({"_saved": sorted(found)})
    bests = [
        (best_score(m.group(2), float(m.group(3)), mode), p.name)
        # .pt and .safetensors: best_format may change on resume.
        for p in Path(dirname).glob("best_model_*")
        if (m := BEST_NAME.match(p.name))
    ]
    best.load_state_dict({"_saved": sorted(bests)})


def _complete_or_set_aside(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint that rotation may count. A corrupt or truncated one never counts
    toward ``n_saved`` (it would push a good one out) and is never deleted: rank 0 moves it aside as
    ``<name>.corrupt`` and says so."""
    if is_complete(path):
        return True
    if idist.get_rank() == 0:
        aside = path.with_name(path.name + CORRUPT_SUFFIX)
        try:
            path.rename(aside)
        except OSError as err:
            logger.warning(
                "%s is corrupt or truncated and could not be moved aside (%s); it is left as it is", path, err
            )
        else:
            logger.warning(
                "%s is corrupt or truncated: moved aside as %s (never counted among checkpoint.n_saved, never deleted)",
                path,
                aside.name,
            )
    return False
