"""Whether a checkpoint continues this run: the settings that define a run (``run_signature``, saved in every
checkpoint), the checkpoint that ``resume`` restores (``resume_target``), and the check of one against the other,
run by the launching process before any worker starts (``check_resume_target``: only the checkpoint's ``run`` entry
is read) and again by every worker before anything is loaded. Imports neither torch nor ignite at import."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ignite_mgpu.checkpoint.files import (
    TRAIN_STATE,
    find_resumable,
    is_safetensors,
    read_checkpoint,
    weights_only_resume,
)
from ignite_mgpu.config.schema import Config
from ignite_mgpu.env.cluster import outer_restarts
from ignite_mgpu.errors import CheckpointError
from ignite_mgpu.runs.folder import run_dir

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


def same_run_check(cfg: Config, path: Path) -> Callable[[dict[str, Any]], None]:
    """The check that runs on a checkpoint before anything of it is loaded: it belongs to a run with these settings
    (``run_signature``), unless ``checkpoint.allow_config_change``; and it has the same global batch, whatever that
    allows (``_batch_refusal``)."""
    now = run_signature(cfg)

    def same_run(checkpoint: dict[str, Any]) -> None:
        run = checkpoint.get("run", {})
        saved = run.get("config", {})
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
        if run.get("global_batch", cfg.data.batch_size) != cfg.data.batch_size:
            raise CheckpointError(_batch_refusal(path, run["global_batch"], cfg.data.batch_size))

    return same_run


def _batch_refusal(path: Path, saved: int, now: int) -> str:
    """Why a checkpoint is not resumed with another global batch, even with checkpoint.allow_config_change=true."""
    return (
        f"{path} was trained with data.batch_size={saved}, and this run asks for {now}: checkpoint."
        "allow_config_change=true lets other settings change, not the global batch. The checkpoint counts the run in "
        f"batches of {saved} (its epoch's length in iterations, its position in the epoch, its schedule's steps), "
        f"which batches of {now} do not continue: an epoch of its iterations would cover {now / saved:.3g}x the data. "
        f"Resume with data.batch_size={saved} (train.micro_batch splits it when memory is short), or start a new run "
        f"from its weights: `ignite-mgpu checkpoint convert {path} weights.safetensors`, then --resume "
        "weights.safetensors in a new --output-dir."
    )


def _run_entry(path: Path) -> dict[str, Any]:
    """A checkpoint's ``run`` entry (settings, global batch, processes): a full file is mapped, its tensors never
    copied; a sharded folder's ``train_state.pt`` is small."""
    if path.is_dir():
        return dict(read_checkpoint(path / TRAIN_STATE).get("run") or {})
    try:
        return dict(read_checkpoint(path, mmap=True).get("run") or {})
    except CheckpointError:  # a file torch cannot map (not its zip format): read whole
        return dict(read_checkpoint(path).get("run") or {})


def check_resume_target(cfg: Config) -> None:
    """Before any worker starts: the checkpoint that ``cfg.resume`` continues belongs to this run (``same_run_check``),
    so that a mismatch is exit 2 before anything starts, not a failed rank. Nothing to check for a new run or the
    weights of a .safetensors file."""
    path = resume_target(cfg) if cfg.resume is not None else None
    if path is None or is_safetensors(path) or not path.exists():
        return
    same_run_check(cfg, path)({"run": _run_entry(path)})
