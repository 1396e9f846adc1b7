"""The default job's entries, shared by the CLI and Python code: ``fit`` trains after every pre-flight check the
CLI makes, ``evaluate`` scores saved weights. Both return the job's exit code (errors.EXIT_CODES)."""

from __future__ import annotations

import sys
from pathlib import Path

from ignite_mgpu import launcher
from ignite_mgpu.config import Config, validate
from ignite_mgpu.errors import CheckpointError, ConfigError
from ignite_mgpu.preflight import prepared


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

    Returns:
        0 on success; 2 (the reason printed as one paragraph on stderr) when a check fails, 1 for a corrupt
        ``resume`` file; otherwise the job's code: 1 a rank failed, 3 diverged, 130/143 stopped by a signal.
    """
    cfg = cfg if cfg is not None else Config()
    try:
        validate(cfg)
        with prepared(cfg) as plan:
            # Only the target's name is pickled for the workers: this process never imports ignite.
            return launcher.run_plan(plan, launcher.run_named, "ignite_mgpu.train:training", cfg)
    except (ConfigError, CheckpointError) as err:
        return _refused(err)


def evaluate(cfg: Config, checkpoint: str | Path, as_json: bool = False) -> int:
    """Score the weights in ``checkpoint`` on ``cfg``'s validation split, on the processes ``cfg.dist`` asks for;
    rank 0 prints the metrics. The checkpoint is checked against the model before any worker starts."""
    from ignite_mgpu.checkpoint.load import load_checkpoint
    from ignite_mgpu.data import build_datasets, example_inputs
    from ignite_mgpu.models import create_model
    from ignite_mgpu.train import evaluation

    try:
        validate(cfg)
        splits = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
        model = create_model(cfg.model, example_inputs(splits.val, splits.collate_fn))
        load_checkpoint(checkpoint, {"model": model}, map_location="cpu")
        plan = launcher.make_plan(cfg.dist)
    except (ConfigError, CheckpointError) as err:
        return _refused(err)
    return launcher.run_plan(plan, evaluation, cfg, str(checkpoint), as_json)
