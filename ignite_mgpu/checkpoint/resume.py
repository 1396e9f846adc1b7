"""Resuming a run: which settings define it (the run signature saved in every checkpoint), and restoring every
object from a checkpoint after checking that it belongs to the same run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ignite.distributed as idist

from ignite_mgpu.checkpoint.files import find_resumable, is_safetensors, weights_only_resume
from ignite_mgpu.checkpoint.load import load_checkpoint
from ignite_mgpu.checkpoint.sharded import load_sharded
from ignite_mgpu.config.schema import Config
from ignite_mgpu.env.cluster import outer_restarts
from ignite_mgpu.errors import CheckpointError
from ignite_mgpu.runs.folder import run_dir

logger = logging.getLogger("ignite_mgpu")

# Keys that may change between an interrupted run and its resumption without making it another run.
RESUMABLE_CHANGES = (
    "resume",
    "output_dir",
    "train.epochs",
    "train.micro_batch",  # the parts of a batch: the same gradient
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
    "eval.",  # what validation reports, not what is trained
)


def run_signature(cfg: Config) -> dict[str, str]:
    """The config keys that define a run, flattened ("optim.lr" -> "0.05"); compared on resume."""
    from omegaconf import OmegaConf

    def flat(node: Any, prefix: str = "") -> dict[str, str]:
        # An empty one stays a key ("{}"): a key added there is then a change.
        if isinstance(node, dict) and node:
            return {k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix[:-1]: str(node)}

    everything = flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    signature = {k: v for k, v in everything.items() if not k.startswith(RESUMABLE_CHANGES)}
    # The schedule's own state holds the run's length.
    if cfg.optim.scheduler not in ("cosine", "constant"):
        signature["train.epochs"] = everything["train.epochs"]
    return signature


def resume_target(cfg: Config) -> Path | None:
    """What ``cfg.resume`` restores: for "auto" the newest complete checkpoint (None: none yet); for a .safetensors
    file its weights, unless torchrun or SLURM started the job again after it wrote checkpoints of its own, which
    it then continues (the same command line serves the first start and the requeued ones)."""
    if cfg.resume == "auto":
        return find_resumable(run_dir(cfg.output_dir))
    path = Path(str(cfg.resume))
    if weights_only_resume(cfg.resume) and outer_restarts():
        return find_resumable(run_dir(cfg.output_dir)) or path
    return path


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
    same_run = _same_run_check(cfg, path)
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


def _same_run_check(cfg: Config, path: Path) -> Callable[[dict[str, Any]], None]:
    """The check that runs on a checkpoint before anything of it is loaded: it belongs to a run with these settings
    (``run_signature``), unless ``checkpoint.allow_config_change``."""
    now = run_signature(cfg)

    def same_run(checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("run", {}).get("config", {})
        changed = [f"{k}: {v} -> {now.get(k, 'absent')}" for k, v in saved.items() if v != now.get(k, "absent")]
        if changed and not cfg.checkpoint.allow_config_change:
            why = (
                f" (optim.scheduler={cfg.optim.scheduler} was built for the run's length, which its saved state keeps)"
                if any(c.startswith("train.epochs:") for c in changed)
                else ""
            )
            raise CheckpointError(
                f"{path} belongs to a run with other settings ({'; '.join(changed[:5])}"
                f"{'; ...' if len(changed) > 5 else ''}){why}. Resume with the same settings, use a new --output-dir, "
                "or pass checkpoint.allow_config_change=true to resume anyway."
            )

    return same_run


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
