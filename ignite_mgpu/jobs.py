"""The default job's entries, shared by the CLI and Python code: ``fit`` trains after every pre-flight check the
CLI makes, ``evaluate`` scores saved weights. Both return the job's exit code (errors.EXIT_CODES); ``fit``'s comes
with the run's folder, its last epoch's metrics and its best model (``FitResult``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ignite_mgpu import text
from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.loading import dotted_keys
from ignite_mgpu.config.schema import Config, DistConfig
from ignite_mgpu.env import cluster
from ignite_mgpu.errors import NOTHING_FITS, SUCCESS, CheckpointError, Checks, ConfigError
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.gpus.ranges import gpu_range
from ignite_mgpu.preflight import (
    check_datasets,
    check_job,
    check_model_options,
    check_no_foreign_checkpoints,
    check_output_dir,
    warn_double_warmup,
    warn_restarts_without_checkpoints,
)
from ignite_mgpu.processes import forkserver, launcher
from ignite_mgpu.processes.job import Job, Restart
from ignite_mgpu.processes.launcher import in_workers
from ignite_mgpu.processes.plan import LaunchPlan, make_plan
from ignite_mgpu.runs import folder
from ignite_mgpu.runs.folder import run_dir
from ignite_mgpu.runs.lock import output_lock
from ignite_mgpu.runs.read import best_model, last_epoch

TRAINING = "ignite_mgpu.train.default_job:training"
SCORING = "ignite_mgpu.train.default_job:scoring"


def said(message: str) -> str:
    """``message`` as the caller speaks: flags on the command line, config keys (``resume=auto``) in Python."""
    return message if text.ON_COMMAND_LINE.get() else text.as_settings(message, dotted_keys())


def refused(err: ConfigError | CheckpointError) -> int:
    if detail := getattr(err, "detail", ""):
        print(detail.rstrip(), file=sys.stderr)  # e.g. the traceback of the user's own factory
    print(f"ignite-mgpu: error: {said(str(err))}", file=sys.stderr)
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
        The exit code, an int (a ``FitResult``): 0 on success; 2 (the reason printed as one paragraph on stderr)
            when a check fails, 1 for a corrupt ``resume`` file, 4 when ``dist.wait`` ran out before the GPUs were
            free (130 on Ctrl-C while waiting); otherwise the job's code: 1 a rank failed, 3 diverged, 130/143
            stopped by a signal. Its ``output_dir``, ``metrics`` and ``best_model`` say what the run left.
    """
    cfg = cfg if cfg is not None else Config()
    try:
        validate(cfg)
        # The fork server imports torch and the training code while this process makes the plan.
        with prepared(cfg, forkserver.preload_for(Job(TRAINING))) as (resolved, plan, claims):
            # Only the function's name is pickled for the workers: this process never imports ignite.
            out = run_dir(resolved.output_dir)
            restart = functools.partial(_resume_newest, resolved)
            ended = launcher.run_job(plan, Job(TRAINING, (resolved,)), claims, restart, run_dir=str(out))
            code = ended.outcome.code
    except (ConfigError, CheckpointError) as err:
        return FitResult(refused(err))
    return FitResult(code, out, last_epoch(out), best_model(out))


def _resume_newest(cfg: Config, restarts: int) -> Restart:
    """What the default job runs after ``restarts`` restarts (or a change of size): ``--resume auto``, the newest
    complete checkpoint in output_dir (or from the beginning when none was written yet, from the weights of a
    ``--resume X.safetensors`` start); named here for the supervisor's message. The restart count reaches the
    workers as TORCHELASTIC_RESTART_COUNT."""
    from ignite_mgpu.checkpoint.files import CKPT_NAME, find_resumable, weights_only_resume

    path = find_resumable(run_dir(cfg.output_dir))
    match = CKPT_NAME.match(path.name) if path is not None else None
    if path is None and weights_only_resume(cfg.resume):
        return Restart((cfg,), str(cfg.resume), 0)
    resumed = dataclasses.replace(cfg, resume="auto")
    return Restart((resumed,), str(path) if path is not None else None, int(match.group(1)) if match else 0)


def is_leader(cfg: Config, environ: Mapping[str, str] = os.environ) -> bool:
    """The job's first process. Only it checks and locks output_dir: other nodes may share the folder (NFS), and
    under torchrun/SLURM every process runs the same command."""
    return cfg.dist.node_rank == 0 and cluster.is_first_process(environ)


def resolve_output_dir(cfg: Config, environ: Mapping[str, str] = os.environ, now: float | None = None) -> Config:
    """``cfg`` with a folder of its own under runs/ for a run without ``output_dir``, so that the same
    command can run twice; ``--resume auto`` without one continues the newest there. A folder the user names is
    left as it is. The caller's ``cfg`` is never changed.

    Under torchrun/SLURM every process runs this: the folder is named by the job's id (SLURM_JOB_ID, torchrun's
    --rdzv-id), which every process and every requeue of the job shares.
    """
    if cfg.output_dir is not None:
        return cfg
    job_id = cluster.job_id(environ)
    if cluster.started_externally(environ):
        if job_id is None:
            raise ConfigError(
                "under torchrun without --rdzv-id every process would pick its own folder: pass --output-dir (or "
                "output_dir=...), or give torchrun --rdzv-id."
            )
        chosen = folder.RUNS / f"job-{job_id}"
    elif cfg.resume == "auto" and (earlier := folder.earlier_runs()):
        chosen = earlier[-1]
    # A new run (--resume auto with no earlier run starts one too, as on a first start under a scheduler)
    else:
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now))
        chosen, n = folder.RUNS / stamp, 1
        while chosen.exists():
            n += 1
            chosen = folder.RUNS / f"{stamp}-{n}"
    return dataclasses.replace(cfg, output_dir=str(chosen))


@contextlib.contextmanager
def checked_plan(cfg: Config) -> Iterator[tuple[LaunchPlan, GpuClaims]]:
    """The launch plan and the GPU claims it made, held while the caller runs the job, and the checks that need the
    plan: the model options its device allows, the datasets over its processes. ``train`` and ``evaluate`` both
    run them, after ``check_job``; a failed check lets the GPUs go at once."""
    dist, messages = range_within_the_data(cfg)
    plan, claims = make_plan(dist)
    with claims:
        check_model_options(cfg, plan)
        check_datasets(cfg, plan.world_size)
        yield dataclasses.replace(plan, messages=(*messages, *plan.messages)), claims


def range_within_the_data(cfg: Config) -> tuple[DistConfig, tuple[str, ...]]:
    """An elastic job's ``dist`` with its range cut to the most processes that the data splits over (the checks of
    a start, for every size it could take: ``check_datasets``), and the line that says so; else ``cfg.dist``. A job
    on ``auto:2-4`` whose batch of 3 cannot be split over 4 runs on 2 or 3 GPUs and never takes a fourth."""
    elastic = gpu_range(cfg.dist.gpus)
    if elastic is None or cfg.dist.strategy == "dp" or cfg.dist.nnodes > 1:  # dp: one process, whatever the GPUs
        return cfg.dist, ()
    most, why = check_datasets(cfg, elastic.low, elastic.high)
    if most == elastic.high:
        return cfg.dist, ()
    said = (
        f"--gpus auto:{elastic} takes at most {most} GPUs (auto:{elastic.low}-{most}), now and when more free up: {why}"
    )
    return dataclasses.replace(cfg.dist, gpus=f"auto:{elastic.low}-{most}"), (said,)


@contextlib.contextmanager
def prepared(cfg: Config, preload: list[str] | None = None) -> Iterator[tuple[Config, LaunchPlan, GpuClaims]]:
    """Run every check, name the output folder, decide the launch plan, and hold the GPU claims and the output
    folder's lock while the caller runs the job; yields the config with its output folder named (``cfg`` itself
    is left as it is), the plan and the claims. ``preload``: the fork server's modules (``forkserver.preload_for``);
    when the job runs in workers, the server starts once every check has passed (bad input never starts a process)
    and imports them while the output folder is locked and the supervisor starts (stopped here if the job does not
    start; the supervisor stops it when the job ends).

    Raises:
        ConfigError, CheckpointError: before anything was started or created.
    """
    from ignite_mgpu.train.tracking.packages import check_trackers  # torch-free, as the launcher stays

    # What the config names, then where the run goes: every mistake at once, in that order.
    checks = Checks()
    with checks.one():
        check_job(cfg)
    with checks.one():
        check_trackers(cfg.train)  # training's alone: evaluate logs to no tracker
    chosen = cfg.output_dir is None
    cfg = resolve_output_dir(cfg)
    leader = is_leader(cfg)
    if leader:
        with checks.one():
            check_output_dir(cfg)
    checks.raise_found()
    if leader:
        warn_restarts_without_checkpoints(cfg)
        warn_double_warmup(cfg)
    try:
        with checked_plan(cfg) as (plan, claims):
            # Every check passed, the GPUs are the job's: said once it is sure to be made (not before a refusal).
            if chosen:
                print(said(f"ignite-mgpu: output_dir {cfg.output_dir} (--output-dir chooses one)"), file=sys.stderr)
            # Bad input never starts a process.
            if preload is not None and in_workers(plan):
                forkserver.start(preload, cluster.signal_number(cfg.dist.preempt_signal))
            if not leader:
                yield cfg, plan, claims
                return
            with output_lock(run_dir(cfg.output_dir)):
                # Again under the lock: a job may have run there since the check.
                check_no_foreign_checkpoints(cfg)
                yield cfg, plan, claims
    finally:
        forkserver.stop()


def evaluate(cfg: Config, checkpoint: str | Path, as_json: bool = False) -> int:
    """Score the weights in ``checkpoint`` on ``cfg``'s validation split, on the processes ``cfg.dist`` asks for;
    rank 0 prints the metrics. Before any worker starts: ``train``'s checks (but the output folder's, as nothing
    is written) and the checkpoint against the model. That check imports torch here; the fork server imports it
    beside it, and a refusal stops the server before the error is said (nothing is left)."""
    try:
        validate(cfg)
        check_job(cfg)
        job = Job(SCORING, (cfg, str(checkpoint), as_json))
        with checked_plan(cfg) as (plan, claims):
            try:
                if in_workers(plan):
                    forkserver.start(forkserver.preload_for(job), cluster.signal_number(cfg.dist.preempt_signal))
                check_checkpoint_fits(cfg, checkpoint)
                return launcher.run_job(plan, job, claims).outcome.code
            finally:
                forkserver.stop()
    except (ConfigError, CheckpointError) as err:
        return refused(err)


def check_checkpoint_fits(cfg: Config, checkpoint: str | Path) -> None:
    """CheckpointError unless ``checkpoint``'s model weights load into ``cfg``'s model."""
    from ignite_mgpu.checkpoint.load import load_checkpoint
    from ignite_mgpu.train.data.datasets import build_datasets, example_inputs
    from ignite_mgpu.train.models import create_model

    splits = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
    model = create_model(cfg.model, example_inputs(splits.val, splits.collate_fn))
    load_checkpoint(checkpoint, {"model": model}, map_location="cpu")


def plan_memory(cfg: Config, as_json: bool = False) -> int:
    """Print the memory plan of ``cfg`` (``ignite-mgpu plan``): per process, parameters, gradients, optimizer state,
    activations per sample and the peak of a training step under ddp, dp and fsdp, measured on fake tensors (nothing
    allocated, no process started), and which strategy and micro-batch fit the selected GPUs' free memory (on a
    machine without GPUs: the available RAM). Returns 0; 2 with the reason when a check fails (``--gpus 2,3`` on
    a machine without them, as ``train``; a torch without the memory trackers); 5 (NOTHING_FITS) after the table
    when nothing fits, not even one sample per process, so that a script can test the plan's answer."""
    try:
        from ignite_mgpu.memory.budget import capacity, make_memory_plan
        from ignite_mgpu.memory.table import format_plan, to_json
    except ModuleNotFoundError as err:  # PyTorch's memory trackers are newer than the oldest torch trains with
        if not (err.name or "").startswith("torch."):
            raise
        import torch

        return refused(
            ConfigError(
                f"ignite-mgpu plan measures a step with PyTorch's memory trackers ({err.name}), which torch "
                f"{torch.__version__} does not have. Upgrade torch to plan (pip install -U torch); training works "
                "without the plan, and train.micro_batch=auto splits the batch after an out-of-memory error."
            )
        )
    try:
        validate(cfg)
        check_job(cfg)
        plan = make_memory_plan(cfg, capacity(cfg))
    except ConfigError as err:
        return refused(err)
    print(to_json(plan) if as_json else format_plan(plan))
    return NOTHING_FITS if plan.nothing_fits else SUCCESS
