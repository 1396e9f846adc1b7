"""The default job's entries, shared by the CLI and Python code: ``fit`` trains after every pre-flight check the
CLI makes, ``evaluate`` scores saved weights. Both return the job's exit code (errors.EXIT_CODES)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

from ignite_mgpu.config import Config, run_dir, validate
from ignite_mgpu.errors import CheckpointError, ConfigError
from ignite_mgpu.preflight import check_job, checked_plan, prepared
from ignite_mgpu.processes import cluster, launcher
from ignite_mgpu.processes.plan import Restart

TRAINING = "ignite_mgpu.train.job:training"


def _refused(err: ConfigError | CheckpointError) -> int:
    if detail := getattr(err, "detail", ""):
        print(detail.rstrip(), file=sys.stderr)  # e.g. the traceback of the user's own factory
    print(f"ignite-mgpu: error: {err}", file=sys.stderr)
    return err.exit_code


def fit(cfg: Config | None = None) -> int:
    """Train the default job (``train.training``) as ``ignite-mgpu train`` does, with the same checks.

    Before anything starts: the config's values, the model name, the output folder (not locked by another job, no
    other run's checkpoints, a resumable ``resume`` target), the dataset sizes and the GPU request. While the job
    runs, ``output_dir`` is locked. Build ``cfg`` with ``load_config`` (or ``Config(...)``; None: the defaults).
    With ``dist.max_restarts``, a failed job restarts from the newest complete checkpoint in ``output_dir``.

    Returns:
        0 on success; 2 (the reason printed as one paragraph on stderr) when a check fails, 1 for a corrupt
        ``resume`` file, 4 when ``dist.wait`` ran out before the GPUs were free; otherwise the job's code: 1 a rank
        failed, 3 diverged, 130/143 stopped by a signal.
    """
    cfg = cfg if cfg is not None else Config()
    try:
        validate(cfg)
        with prepared(cfg) as plan:
            # Only the target's name is pickled for the workers: this process never imports ignite.
            restart = functools.partial(_resume_newest, cfg, cluster.outer_restarts())
            return launcher.run_plan(plan, launcher.run_named, TRAINING, cfg, restart=restart)
    except (ConfigError, CheckpointError) as err:
        return _refused(err)


def _resume_newest(cfg: Config, outer_restarts: int, attempt: int) -> Restart:
    """Restart ``attempt`` of the default job: ``--resume auto``, the newest complete checkpoint in output_dir (or
    from the beginning when none was written yet); named here for the supervisor's log line."""
    from ignite_mgpu.checkpoint.files import CKPT_NAME, find_resumable

    path = find_resumable(run_dir(cfg))
    match = CKPT_NAME.match(path.name) if path is not None else None
    args = (TRAINING, dataclasses.replace(cfg, resume="auto"), outer_restarts + attempt)
    return Restart(args, str(path) if path is not None else None, int(match.group(1)) if match else 0)


def evaluate(cfg: Config, checkpoint: str | Path, as_json: bool = False) -> int:
    """Score the weights in ``checkpoint`` on ``cfg``'s validation split, on the processes ``cfg.dist`` asks for;
    rank 0 prints the metrics. Before any worker starts: ``train``'s checks (but the output folder's, as nothing
    is written) and the checkpoint against the model."""
    from ignite_mgpu.checkpoint.load import load_checkpoint
    from ignite_mgpu.train.datasets import build_datasets, example_inputs
    from ignite_mgpu.train.job import scoring
    from ignite_mgpu.train.models import create_model

    try:
        validate(cfg)
        check_job(cfg)
        plan = checked_plan(cfg)
        splits = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
        model = create_model(cfg.model, example_inputs(splits.val, splits.collate_fn))
        load_checkpoint(checkpoint, {"model": model}, map_location="cpu")
    except (ConfigError, CheckpointError) as err:
        return _refused(err)
    return launcher.run_plan(plan, scoring, cfg, str(checkpoint), as_json)
