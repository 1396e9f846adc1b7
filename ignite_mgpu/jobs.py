"""The default job's entries, shared by the CLI and Python code: ``fit`` trains after every pre-flight check the
CLI makes, ``evaluate`` scores saved weights. Both return the job's exit code (errors.EXIT_CODES); ``fit``'s comes
with the run's folder, its last epoch's metrics and its best model (``FitResult``)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.schema import Config, run_dir
from ignite_mgpu.errors import CheckpointError, ConfigError
from ignite_mgpu.preflight import check_job, checked_plan, prepared
from ignite_mgpu.processes import cluster, forkserver, launcher
from ignite_mgpu.processes.plan import Restart
from ignite_mgpu.runs.read import best_model, last_epoch

TRAINING = "ignite_mgpu.train.job:training"


def _refused(err: ConfigError | CheckpointError) -> int:
    if detail := getattr(err, "detail", ""):
        print(detail.rstrip(), file=sys.stderr)  # e.g. the traceback of the user's own factory
    print(f"ignite-mgpu: error: {err}", file=sys.stderr)
    return err.exit_code


class FitResult(int):
    """What ``fit`` returns: the job's exit code, as an int (``sys.exit(fit(cfg))`` and ``fit(cfg) == 0`` work), with
    the run's folder (``output_dir``), the last epoch's line of metrics.jsonl (``metrics``: {} before the first
    epoch ended) and the best model's file (``best_model``: None before the first validation)."""

    output_dir: Path | None
    metrics: dict[str, Any]
    best_model: Path | None

    def __new__(
        cls,
        exit_code: int,
        output_dir: Path | None = None,
        metrics: dict[str, Any] | None = None,
        best_model: Path | None = None,
    ) -> FitResult:
        result = super().__new__(cls, exit_code)
        result.output_dir, result.metrics, result.best_model = output_dir, metrics or {}, best_model
        return result

    @property
    def exit_code(self) -> int:
        return int(self)

    def __repr__(self) -> str:
        out, best = (str(p) if p is not None else None for p in (self.output_dir, self.best_model))
        return f"FitResult(exit_code={int(self)}, output_dir={out!r}, best_model={best!r}, metrics={self.metrics!r})"

    __str__ = int.__repr__  # printed or formatted, it is the exit code


def fit(cfg: Config | None = None) -> FitResult:
    """Train the default job (``train.training``) as ``ignite-mgpu train`` does, with the same checks.

    Before anything starts: the config's values, the model name, the output folder (not locked by another job, no
    other run's checkpoints, a resumable ``resume`` target), the dataset sizes and the GPU request. While the job
    runs, ``output_dir`` is locked. Build ``cfg`` with ``load_config`` (or ``Config(...)``; None: the defaults).
    With ``dist.max_restarts``, a failed job restarts from the newest complete checkpoint in ``output_dir``.

    Returns:
        A ``FitResult``, an int: 0 on success; 2 (the reason printed as one paragraph on stderr) when a check
        fails, 1 for a corrupt ``resume`` file, 4 when ``dist.wait`` ran out before the GPUs were free (130 on Ctrl-C
        while waiting); otherwise the job's code: 1 a rank failed, 3 diverged, 130/143 stopped by a signal. Its
        ``output_dir``, ``metrics`` and ``best_model`` say what the run left.
    """
    cfg = cfg if cfg is not None else Config()
    try:
        validate(cfg)
        # The fork server imports torch and the training code while this process makes the plan.
        with prepared(cfg, forkserver.preload_for(launcher.run_named, (TRAINING,))) as plan:
            # Only the target's name is pickled for the workers: this process never imports ignite.
            restart = functools.partial(_resume_newest, cfg, cluster.outer_restarts())
            code = launcher.run_plan(plan, launcher.run_named, TRAINING, cfg, restart=restart)
    except (ConfigError, CheckpointError) as err:
        return FitResult(_refused(err))
    out = run_dir(cfg)  # resolved by the pre-flight: a new folder under runs/ for a run without output_dir
    return FitResult(code, out, last_epoch(out), best_model(out))


def _resume_newest(cfg: Config, outer_restarts: int, attempt: int) -> Restart:
    """Restart ``attempt`` of the default job: ``--resume auto``, the newest complete checkpoint in output_dir (or
    from the beginning when none was written yet, from the weights of a ``--resume X.safetensors`` start); named
    here for the supervisor's log line."""
    from ignite_mgpu.checkpoint.files import CKPT_NAME, find_resumable, weights_only_resume

    path = find_resumable(run_dir(cfg))
    match = CKPT_NAME.match(path.name) if path is not None else None
    if path is None and weights_only_resume(cfg.resume):
        args = (TRAINING, cfg, outer_restarts + attempt)
        return Restart(args, str(cfg.resume), 0)
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


def plan_memory(cfg: Config, as_json: bool = False) -> int:
    """Print the memory plan of ``cfg`` (``ignite-mgpu plan``): per process, parameters, gradients, optimizer state,
    activations per sample and the peak of a training step under ddp, dp and fsdp, measured on fake tensors (nothing
    allocated, no process started), and which strategy and micro-batch fit the selected GPUs' free memory (on a
    machine without GPUs: the available RAM). Returns 0, or 2 with the reason when a check fails."""
    from ignite_mgpu.train.memory_plan import capacity, make_memory_plan
    from ignite_mgpu.train.memory_report import format_plan, to_json

    try:
        validate(cfg)
        check_job(cfg)
        plan = make_memory_plan(cfg, capacity(cfg))
    except ConfigError as err:
        return _refused(err)
    print(to_json(plan) if as_json else format_plan(plan))
    return 0
