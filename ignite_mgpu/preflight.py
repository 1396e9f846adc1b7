"""Checks before anything starts, shared by ``ignite-mgpu train`` and ``ignite_mgpu.fit``: the model, optimizer,
schedule and loss with their arguments (the trackers' packages: ``train/tracking/packages.py``), the output folder
(writable, not locked, no other run's checkpoints, a usable resume target of the same run), the dataset sizes for
the launch plan and for every size of an elastic job; then one job per output folder, held by a lock while the job
runs.

Everything raises ConfigError / CheckpointError (one paragraph each) before a worker is spawned. ignite is never
imported here: the launching process stays light.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ignite_mgpu.config.checks import BUILTIN_LOSSES, check_sizes
from ignite_mgpu.config.schema import (
    DATASETS_ON_DISK,
    GENERATED,
    MODELS,
    OPTIMIZERS,
    SCHEDULES,
    Config,
)
from ignite_mgpu.env import cluster
from ignite_mgpu.errors import Checks, ConfigError, CorruptCheckpointError
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.runs import metric_names
from ignite_mgpu.runs.folder import run_dir
from ignite_mgpu.runs.lock import lock_owner, locked_message
from ignite_mgpu.runs.regular import why_not_regular
from ignite_mgpu.runs.writable import folder_problem


def check_data_root(cfg: Config) -> None:
    """A dataset read from disk needs its folder (and, for imagefolder, the ImageNet layout under it)."""
    d = cfg.data
    if d.name not in DATASETS_ON_DISK or d.root is None:
        return
    root = Path(d.root).expanduser().resolve()
    if not d.download and not root.is_dir():
        hint = " (or data.download=true)" if d.name != "imagefolder" else ""
        raise ConfigError(f"data.root={root} does not exist or is not a folder; pass an existing folder{hint}.")
    if d.name == "imagefolder":
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise ConfigError(
                    f"data.name=imagefolder expects the ImageNet layout root/train/<class>/* and "
                    f"root/val/<class>/*, but {root / split} is missing."
                )


def check_job(cfg: Config) -> None:
    """What the config names must exist: the data folder, the model, the optimizer, schedule and loss (with the
    arguments the config gives them), and the packages the chosen options need. Built-in names without extra
    arguments need nothing checked here (the config's checks know them): only a torchvision model, a torch class,
    a factory of the user's or extra arguments import torch and the module that builds them."""
    checks = Checks()  # each mistake of the config's names at once, in the file's order
    for check in (_check_data_source, _check_model, _check_optim, _check_loss, check_metric_factories):
        with checks.one():
            check(cfg)
    if not checks.found:  # calls what the checks above found sound: a mistake there would be met again
        with checks.one():
            _check_factories(cfg)
    checks.raise_found()


def _check_data_source(cfg: Config) -> None:
    """The data folder, or a dataset factory's module and name (built later, with the launch plan's processes)."""
    check_data_root(cfg)
    if ":" in cfg.data.name:
        from ignite_mgpu.train.plugins import resolve

        resolve(cfg.data.name, "data.name")


def _check_model(cfg: Config) -> None:
    if cfg.model.name not in MODELS or cfg.model.args:
        from ignite_mgpu.train.models import check_model

        check_model(cfg.model)


def _check_optim(cfg: Config) -> None:
    o = cfg.optim
    builtin_optim = o.name in OPTIMIZERS and o.scheduler in SCHEDULES and o.param_groups is None
    if not builtin_optim or o.args or o.scheduler_args:
        from ignite_mgpu.train.optim import check_optim

        check_optim(o)


def _check_loss(cfg: Config) -> None:
    # A built-in's arguments: config.checks, with the config.
    if cfg.train.loss not in BUILTIN_LOSSES:
        # The user's factory: its module is imported to check it.
        from ignite_mgpu.train.losses import check_loss

        check_loss(cfg.train.loss, cfg.train.loss_args)


def _check_factories(cfg: Config) -> None:
    m, o = cfg.model, cfg.optim
    # The user's code ("package.module:factory"): called once here, as in the workers.
    if any(":" in name for name in (m.name, o.name, o.param_groups or "", cfg.train.loss)):
        from ignite_mgpu.train.models import check_factories

        check_factories(m, cfg.train.loss, cfg.train.loss_args, o)


def check_metric_factories(cfg: Config) -> None:
    """Every ``package.module:factory`` of ``eval.metrics`` imports, and takes its ``eval.metric_args`` (and the
    ``device`` the workers add when it takes one); the workers call it."""
    from ignite_mgpu.train import plugins

    for entry in filter(plugins.is_factory, cfg.eval.metrics or ()):
        factory = plugins.resolve(entry, "eval.metrics")
        name = metric_names.name_of(entry)
        kwargs = plugins.with_extras(factory, cfg.eval.metric_args.get(name, {}), device="cpu")
        plugins.check_arguments(factory, kwargs, entry, f"eval.metric_args.{name}")


def check_model_options(cfg: Config, plan: LaunchPlan) -> None:
    """Model options that need what the plan's device lacks: SyncBatchNorm and FSDP's CPU offload need CUDA (and
    FSDP itself before PyTorch 2.6), and torch.compile on the CPU a C++ compiler (its inductor backend builds C++
    kernels); ``model.fsdp_blocks`` must name classes of the model."""
    if cfg.model.fsdp_cpu_offload and plan.device == "cpu":
        raise ConfigError(
            "model.fsdp_cpu_offload=true keeps FSDP's sharded parameters, gradients and optimizer state in CPU memory "
            "between their uses on a GPU, and this job trains on the CPU, where they are in CPU memory already "
            "(PyTorch's offload needs CUDA). Set model.fsdp_cpu_offload=false, or train on GPUs."
        )
    if cfg.model.fsdp_blocks is not None:
        check_fsdp_blocks(cfg)
    if cfg.dist.strategy == "fsdp":
        from ignite_mgpu.parallel.fsdp import check_device

        check_device(plan.device, plan.world_size)
    if cfg.model.sync_batchnorm and plan.device == "cpu" and plan.world_size > 1:
        raise ConfigError(
            "model.sync_batchnorm=true: PyTorch's SyncBatchNorm only works on CUDA GPUs, and this job trains on "
            "the CPU. Set model.sync_batchnorm=false (each process then normalises over its own share of the "
            "batch), or train on GPUs."
        )
    if cfg.model.compile and plan.device == "cpu":
        names = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
        if not any(name and shutil.which(name) for name in names):
            raise ConfigError(
                "model.compile=true on the CPU needs a C++ compiler (torch.compile builds C++ kernels), and none "
                "was found (CXX, g++, clang++ or c++ on PATH). Install one (e.g. apt install g++), point CXX at it, "
                "or set model.compile=false."
            )


def check_fsdp_blocks(cfg: Config) -> None:
    """``model.fsdp_blocks`` against the model's classes, with the model built on the meta device (no memory, no
    initialisation). A factory that cannot build there is checked by the workers instead, with the same message."""
    import torch

    from ignite_mgpu.parallel.fsdp import check_blocks
    from ignite_mgpu.train.models import create_model

    try:
        with torch.device("meta"):
            model = create_model(cfg.model)
    # e.g. a factory that loads weights or reads a tensor's value: the workers will tell.
    except Exception:
        return
    check_blocks(model, cfg.model.fsdp_blocks or [], cfg.model.name)


def check_datasets(cfg: Config, world_size: int, up_to: int | None = None) -> tuple[int, str]:
    """Empty splits, a global batch that does not split over ``world_size``, too few samples per process, and a
    dataset whose batches the loss cannot use. A dataset factory runs here once, so that its mistakes are reported
    once, before any worker starts. ``up_to``: an elastic job's MAX processes; returned: the most processes, from
    ``world_size`` up to it, that the sizes allow (every count in between too), and why one more would not ("")."""
    # Sizes known from the config: only the workers generate the data.
    if cfg.data.name in GENERATED:
        return _most_processes(range(cfg.data.train_size), range(cfg.data.val_size), cfg, world_size, up_to)
    from ignite_mgpu.train.data import batches
    from ignite_mgpu.train.data.datasets import build_datasets, first_batch

    splits = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
    most = _most_processes(splits.train, splits.val, cfg, world_size, up_to)
    first = first_batch(splits.train, splits.collate_fn)
    batches.check(first, cfg.train.loss)
    if cfg.train.loss == "model" and "perplexity" in (cfg.eval.metrics or ()):
        try:
            batches.labels(first)
        except TypeError as err:
            raise ConfigError(
                f"eval.metrics entry perplexity with train.loss=model weights each batch's loss by its tokens, "
                f"counted in its labels, but {err} Add the labels to the dataset's items (-100 where nothing is "
                "predicted), or drop perplexity."
            ) from None
    return most


def _most_processes(train: Any, val: Any, cfg: Config, world_size: int, up_to: int | None) -> tuple[int, str]:
    """``check_sizes`` on ``world_size`` processes (raises), then on one more at a time up to ``up_to``."""
    check_sizes(train, val, cfg.data.batch_size, world_size)
    for more in range(world_size + 1, (up_to or world_size) + 1):
        try:
            check_sizes(train, val, cfg.data.batch_size, more)
        except ConfigError as err:
            return more - 1, str(err)
    return max(world_size, up_to or world_size), ""


def check_output_dir(cfg: Config) -> None:
    """Never mix two runs' checkpoints, never write where another job writes; ``--resume`` must name something
    resumable, of this run (its settings and global batch: ``check_resume_target``)."""
    from ignite_mgpu.checkpoint.files import is_complete, is_safetensors
    from ignite_mgpu.checkpoint.same_run import check_resume_target

    out = run_dir(cfg.output_dir)
    owner = lock_owner(out)
    if owner is not None:  # before anything else: the checkpoints there are the running job's
        raise ConfigError(locked_message(out, owner))
    if (problem := folder_problem(out)) is not None:
        raise ConfigError(problem)
    check_no_foreign_checkpoints(cfg)
    # --resume auto without a checkpoint starts a new run (training says so): the same command then works on the
    # first start and on every restart by torchrun, SLURM or Kubernetes.
    if cfg.resume not in (None, "auto"):
        path = Path(cfg.resume)
        if not path.exists():
            raise ConfigError(
                f"--resume {path}: no such file. Pass a checkpoint_<iteration>.pt path, a checkpoint_<iteration> "
                "folder (checkpoint.format=sharded), a .safetensors file (a new run from its weights), or auto."
            )
        if not path.is_dir() and (why := why_not_regular(path)) is not None:
            raise ConfigError(
                f"--resume {path}: it {why}. Pass a checkpoint_<iteration>.pt file, a checkpoint_<iteration> folder "
                "(checkpoint.format=sharded), a .safetensors file, or auto."
            )
        if path.is_dir() and not is_complete(path):
            raise CorruptCheckpointError(
                f"--resume {path.resolve()}: the folder is not a complete sharded checkpoint (no .metadata or "
                "train_state.pt: its writer was stopped, or it is another folder). Use an earlier checkpoint, or "
                "--resume auto to pick the newest complete one."
            )
        if not is_complete(path):
            what = "safetensors file" if is_safetensors(path) else "checkpoint archive"
            raise CorruptCheckpointError(
                f"--resume {path.resolve()}: the file is corrupt or truncated (not a complete {what}). Use an "
                "earlier checkpoint, or --resume auto to pick the newest complete one."
            )
    check_resume_target(cfg)


def check_no_foreign_checkpoints(cfg: Config) -> None:
    """A new run (no --resume, or a .safetensors file's weights) needs an output_dir without checkpoints; checked
    again once the lock is held."""
    from ignite_mgpu.checkpoint.files import list_checkpoints, weights_only_resume

    out = run_dir(cfg.output_dir)
    existing = list_checkpoints(out) if out.is_dir() else []
    # A requeued job continues the checkpoints it wrote itself.
    if weights_only_resume(cfg.resume) and existing and not cluster.outer_restarts():
        raise ConfigError(
            f"--resume {cfg.resume} starts a new run from its weights (a fresh optimizer and schedule, epoch 0), but "
            f"output_dir {out.resolve()} already holds checkpoints of an earlier run ({existing[0].name}, ...), "
            "which would mix with the new run's. Choose a new --output-dir, or continue that run exactly with "
            "--resume auto; nothing was deleted."
        )
    if cfg.resume is None and existing:
        raise ConfigError(
            f"output_dir {out.resolve()} already holds checkpoints of an earlier run ({existing[0].name}, ...). "
            "Continue it with --resume auto, or choose a new --output-dir; nothing was deleted."
        )


def warn_double_warmup(cfg: Config) -> None:
    """OneCycleLR warms up itself (``pct_start``): ``optim.warmup_epochs`` before it is allowed, with a warning."""
    o = cfg.optim
    if o.scheduler == "OneCycleLR" and o.warmup_epochs:
        print(
            f"ignite-mgpu: warning: optim.warmup_epochs={o.warmup_epochs} before optim.scheduler=OneCycleLR, which "
            "warms up itself: the learning rate climbs to optim.lr, falls to max_lr / div_factor and climbs again. Set "
            "optim.warmup_epochs=0 for OneCycleLR's own warm-up alone.",
            file=sys.stderr,
        )


def warn_restarts_without_checkpoints(cfg: Config) -> None:
    """--max-restarts with no checkpoint at all is allowed (a restart then starts from the beginning), with a
    warning, once per job."""
    c = cfg.checkpoint
    if cfg.dist.max_restarts and not (c.every or c.every_iters or c.every_minutes):
        print(
            f"ignite-mgpu: warning: --max-restarts {cfg.dist.max_restarts} without checkpoints (checkpoint.every=0, "
            "checkpoint.every_iters=0, checkpoint.every_minutes=null): every restart starts the training from the "
            "beginning. Set checkpoint.every_minutes (e.g. 10) or checkpoint.every so that a restart resumes "
            "close to where the job failed.",
            file=sys.stderr,
        )
