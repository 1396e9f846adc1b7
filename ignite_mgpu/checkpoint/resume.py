"""Resuming a run: which settings define it (the run signature saved in every checkpoint), and restoring every
object from a checkpoint after checking that it belongs to the same run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ignite_mgpu.checkpoint.files import find_resumable
from ignite_mgpu.checkpoint.load import load_checkpoint
from ignite_mgpu.checkpoint.sharded import load_sharded
from ignite_mgpu.checkpoint.state import FullModelState
from ignite_mgpu.config import Config, run_dir
from ignite_mgpu.errors import CheckpointError

logger = logging.getLogger("ignite_mgpu")

# Keys that may change between an interrupted run and its resumption without making it another run.
RESUMABLE_CHANGES = (
    "resume",
    "output_dir",
    "train.epochs",
    "train.progress_bar",
    "train.tensorboard",
    "train.loggers",
    "train.log_every",
    "train.logger_args",
    "train.check_every",
    "train.keep_cpu_memory",
    "data.num_workers",
    "data.download",
    "data.root",
    "model.fsdp_",  # how the model is sharded, not what it computes
    "dist.",
    "checkpoint.",
)


def run_signature(cfg: Config) -> dict[str, str]:
    """The config keys that define a run, flattened ("optim.lr" -> "0.05"); compared on resume."""
    from omegaconf import OmegaConf

    def flat(node: Any, prefix: str = "") -> dict[str, str]:
        if isinstance(node, dict):
            return {k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix[:-1]: str(node)}

    everything = flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    return {k: v for k, v in everything.items() if not k.startswith(RESUMABLE_CHANGES)}


def resume(cfg: Config, to_save: dict[str, Any], world_size: int) -> bool:
    """Restore every object from ``cfg.resume`` (a file or a sharded folder, or "auto": the newest complete one;
    when there is none yet, nothing is restored and a new run starts, with a warning).

    Returns False when the checkpoint already finished ``train.epochs`` (nothing left to train).
    """
    path = find_resumable(run_dir(cfg)) if cfg.resume == "auto" else Path(str(cfg.resume))
    if path is None:
        import ignite.distributed as idist

        if idist.get_rank() == 0:
            logger.warning(
                "--resume auto: no complete checkpoint in %s yet: starting a new run", run_dir(cfg).resolve()
            )
        return True
    now = run_signature(cfg)

    def same_run(checkpoint: dict[str, Any]) -> None:  # runs before anything is loaded
        saved = checkpoint.get("run", {}).get("config", {})
        changed = [f"{k}: {v} -> {now.get(k, 'absent')}" for k, v in saved.items() if v != now.get(k, "absent")]
        if changed and not cfg.checkpoint.allow_config_change:
            raise CheckpointError(
                f"{path} belongs to a run with other settings ({'; '.join(changed[:5])}"
                f"{'; ...' if len(changed) > 5 else ''}). Resume with the same settings, use a new --output-dir, "
                "or pass checkpoint.allow_config_change=true to resume anyway."
            )

    if path.is_dir():  # checkpoint.format=sharded: resharded for this process count as it is read
        load_sharded(path, to_save, check=same_run)
    else:
        # A sharded model's full checkpoint stays in CPU memory: each rank copies only its shards to its GPU.
        cpu = isinstance(to_save["model"], FullModelState)
        load_checkpoint(path, to_save, map_location="cpu" if cpu else None, check=same_run)
    saved = to_save["run"].loaded
    logger.info("resumed from %s at iteration %d", path, to_save["trainer"].state.iteration)
    if saved.get("world_size", world_size) != world_size:
        logger.warning(
            "checkpoint was written with %d processes, resuming with %d: the global batch stays %d, each process "
            "now takes %d per step; the resumed epoch restarts its data order for the new process count",
            saved["world_size"],
            world_size,
            cfg.data.batch_size,
            cfg.data.batch_size // world_size,
        )
    state = to_save["trainer"].state
    if state.epoch >= cfg.train.epochs and state.iteration % state.epoch_length == 0:
        logger.warning(
            "%s already finished %d epochs (train.epochs=%d): nothing to train; raise train.epochs to "
            "continue training",
            path,
            state.epoch,
            cfg.train.epochs,
        )
        return False
    return True
