"""The config's value ranges and combinations that the types alone cannot express (``validate``), each refused
with one paragraph naming the key, the value, the rule and the fix. Runs in the parent before anything starts;
what needs the file system or the user's packages is the pre-flight's (``ignite_mgpu.preflight``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ignite_mgpu.config.schema import (
    DATASETS,
    DATASETS_ON_DISK,
    TRACKERS,
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from ignite_mgpu.errors import Checks, ConfigError
from ignite_mgpu.runs import metric_names

# train.loss's own names; anything else is a "package.module:factory"
BUILTIN_LOSSES = ("cross_entropy", "model")
# Reduction stays "mean": the trainer averages.
CROSS_ENTROPY_ARGS = ("label_smoothing", "weight", "ignore_index")


def _check(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r} is invalid: {rule}.")


def validate(cfg: Config) -> None:
    """Check value ranges and combinations that the types alone cannot express. Runs in the parent, before
    spawning; what needs the file system (``data.root``, the output folder) is the pre-flight's (preflight.py)."""
    checks = Checks()  # every section's mistakes at once, in the file's order
    for check in (
        lambda: _check_data(cfg.data, cfg.model),
        lambda: _check_names(cfg),
        lambda: _check_optim(cfg.optim),
        lambda: _check_train(cfg.train, cfg.checkpoint),
        lambda: _check_dist(cfg.dist),
        lambda: _check_strategy_options(cfg),
    ):
        with checks.one():
            check()
    checks.raise_found()


def _check_data(d: DataConfig, m: ModelConfig) -> None:
    _check(d.batch_size >= 1, "data.batch_size", d.batch_size, "the global batch must be at least 1")
    workers = d.num_workers
    workers_ok = workers == "auto" or (type(workers) is int and workers >= 0)
    _check(workers_ok, "data.num_workers", workers, "use 0 (load in the training process), more, or auto")
    _check(d.image_size >= 8, "data.image_size", d.image_size, "use at least 8 pixels")
    _check(d.train_size >= 1 and d.val_size >= 1, "data.train_size/val_size", (d.train_size, d.val_size), "use >= 1")
    _check(m.num_classes >= 2, "model.num_classes", m.num_classes, "a classifier needs >= 2 classes")


def _check_optim(o: OptimConfig) -> None:
    _check(math.isfinite(o.lr) and o.lr > 0, "optim.lr", o.lr, "the learning rate must be a finite number > 0")
    _check(math.isfinite(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "use >= 0")
    _check(0 <= o.momentum < 1, "optim.momentum", o.momentum, "use a value in [0, 1)")
    _check(o.warmup_epochs >= 0, "optim.warmup_epochs", o.warmup_epochs, "use >= 0")
    # That it exists: the pre-flight's.
    for key, name in (("optim.name", o.name), ("optim.scheduler", o.scheduler)):
        _check(
            bool(name) and ("." not in name or ":" in name), key, name, "use a name (Adam) or 'package.module:factory'"
        )
    if o.no_decay_norm_and_bias and o.param_groups:
        raise ConfigError("optim.no_decay_norm_and_bias=true and optim.param_groups both make the groups: choose one.")
    if o.scheduler_args and o.scheduler in ("cosine", "constant"):
        raise ConfigError(
            f"optim.scheduler_args is for a scheduler class or factory, not optim.scheduler={o.scheduler}: drop it."
        )


def _check_train(t: TrainConfig, c: CheckpointConfig) -> None:
    _check(t.epochs >= 1, "train.epochs", t.epochs, "train for at least 1 epoch")
    _check(t.grad_accum_steps >= 1, "train.grad_accum_steps", t.grad_accum_steps, "use 1 (no accumulation) or more")
    mb = t.micro_batch
    _check(
        mb is None or mb == "auto" or (isinstance(mb, int) and mb >= 1),
        "train.micro_batch",
        mb,
        "use null (the whole batch at once), auto (shrink on out-of-memory) or a number of samples >= 1",
    )
    clip = t.clip_grad_norm
    _check(clip is None or (math.isfinite(clip) and clip > 0), "train.clip_grad_norm", clip, "use null or a value > 0")
    _check(t.epoch_length is None or t.epoch_length >= 1, "train.epoch_length", t.epoch_length, "use null or >= 1")
    _check(t.check_every >= 0, "train.check_every", t.check_every, "use 0 (about once a second) or >= 1")
    _check(t.log_every >= 1, "train.log_every", t.log_every, "log the training loss every N >= 1 iterations")
    for name in t.logger_args:
        _check(name in TRACKERS, "train.logger_args", name, f"the keys are tracker names: {', '.join(TRACKERS)}")
    _check(c.every >= 0 and c.every_iters >= 0, "checkpoint.every/every_iters", (c.every, c.every_iters), "use >= 0")
    _check(c.n_saved >= 1, "checkpoint.n_saved", c.n_saved, "keep at least 1 checkpoint")
    minutes = c.every_minutes
    _check(
        minutes is None or (math.isfinite(minutes) and minutes > 0),
        "checkpoint.every_minutes",
        minutes,
        "use null (no time-based checkpoints) or a number of minutes > 0, e.g. 10",
    )
    accum = t.grad_accum_steps
    _check(
        c.every_iters % accum == 0,
        "checkpoint.every_iters",
        c.every_iters,
        f"use a multiple of train.grad_accum_steps={accum}: a checkpoint inside an accumulation window "
        "would lose the gradients accumulated so far",
    )


def _check_dist(dist: DistConfig) -> None:
    _check(dist.nproc is None or dist.nproc >= 1, "dist.nproc", dist.nproc, "run at least 1 process (--nproc 1)")
    _check(dist.nnodes >= 1, "dist.nnodes", dist.nnodes, "use at least 1 node")
    _check(0 <= dist.node_rank < dist.nnodes, "dist.node_rank", dist.node_rank, f"use 0..{dist.nnodes - 1}")
    port = dist.master_port
    _check(port is None or 1 <= port <= 65535, "dist.master_port", port, "use a TCP port in 1..65535")
    _check(dist.timeout > 0 and dist.stop_grace > 0, "dist.timeout/stop_grace", (dist.timeout, dist.stop_grace), "> 0")
    _check(dist.hang_seconds >= 0, "dist.hang_seconds", dist.hang_seconds, ">= 0 (0: no hang watch)")
    _check(
        dist.max_restarts >= 0,
        "dist.max_restarts",
        dist.max_restarts,
        "use 0 (a failed rank ends the job) or a number of restarts, e.g. --max-restarts 3",
    )
    _check_preempt_signal(dist.preempt_signal)
    wait = dist.wait
    _check(wait is None or wait > 0, "dist.wait", wait, "use seconds > 0, .inf (no limit) or null (do not wait)")
    free = dist.min_free_memory
    _check(0 <= free <= 1, "dist.min_free_memory", free, "use a share of the GPU's memory from 0 to 1, e.g. 0.9")
    if dist.share and wait is not None:
        raise ConfigError(
            "--share runs beside the other jobs' claims and --wait waits for them to end: choose one of the two."
        )
    if dist.max_restarts and dist.nnodes > 1:
        raise ConfigError(
            f"--max-restarts {dist.max_restarts} with --nnodes {dist.nnodes}: each node's launcher would restart "
            "only its own processes, and a node that gives up would leave the others waiting at the rendezvous. "
            "Across nodes let the cluster restart the job: torchrun --max-restarts N (with --rdzv-backend c10d) or "
            "SLURM's --requeue, with --resume auto; or drop --max-restarts."
        )
    if dist.nnodes > 1 and port is None:
        raise ConfigError("--nnodes > 1 needs --master-port (and --master-addr, node 0's address) on every node.")


def _check_names(cfg: Config) -> None:
    """The dataset, the loss and the metrics name things that exist, and go together."""
    d, t, c = cfg.data, cfg.train, cfg.checkpoint
    _check(
        d.name in DATASETS or ":" in d.name,
        "data.name",
        d.name,
        f"use {', '.join(DATASETS)}, or 'package.module:factory' for a factory that returns the two datasets",
    )
    if d.args and ":" not in d.name:
        raise ConfigError(
            f"data.args is for a dataset factory (data.name=package.module:factory), not data.name={d.name}."
        )
    if d.name in DATASETS_ON_DISK and d.root is None:
        raise ConfigError(f"data.name={d.name} needs data.root: pass data.root=/path/to/{d.name}.")
    _check(
        t.loss in BUILTIN_LOSSES or ":" in t.loss,
        "train.loss",
        t.loss,
        "use cross_entropy, model (the model's forward returns its loss), or 'package.module:factory' for a factory "
        "that returns a loss function",
    )
    if t.loss in BUILTIN_LOSSES:
        check_loss_args(t.loss, t.loss_args)
    metric_names.check(cfg.eval.metrics, cfg.eval.metric_args, t.loss, c.metric, c.metric_mode)


def _check_strategy_options(cfg: Config) -> None:
    """Options that belong to another strategy than the chosen one."""
    m, strategy = cfg.model, cfg.dist.strategy
    if strategy == "fsdp" and m.sync_batchnorm:
        raise ConfigError(
            "model.sync_batchnorm=true cannot be combined with --strategy fsdp: ignite-mgpu refuses rather than "
            "convert, because SyncBatchNorm's own collectives inside FSDP's sharded forward are a combination PyTorch "
            "does not document and that cannot be tested without GPUs. Use --strategy ddp for SyncBatchNorm, or set "
            "model.sync_batchnorm=false (each process then normalises over its own share of the batch)."
        )
    fsdp_only = [
        f"{key}={value}"
        for key, value, default in (
            ("model.fsdp_blocks", m.fsdp_blocks, None),
            ("model.fsdp_cpu_offload", m.fsdp_cpu_offload, False),
            ("model.fsdp_reshard_after_forward", m.fsdp_reshard_after_forward, True),
        )
        if value != default
    ]
    if fsdp_only and strategy != "fsdp":
        raise ConfigError(
            f"{', '.join(fsdp_only)} is an option of --strategy fsdp, but the strategy is {strategy}, which would "
            "ignore it. Add --strategy fsdp, or drop the option."
        )
    if strategy == "dp" and cfg.checkpoint.format == "sharded":
        raise ConfigError(
            "checkpoint.format=sharded with --strategy dp: DataParallel is one process, so there is nothing to "
            "shard and no other process to write a part. Use checkpoint.format=full (the default)."
        )


PREEMPT_SIGNAL_RULE = (
    "name a signal that a process can catch and that does not already mean stop, such as SIGUSR1 or SIGUSR2 (what "
    "sbatch --signal=USR1@90 sends)"
)


def signal_name(value: str) -> str:
    """A signal's name as ``signal.Signals`` spells it: "USR1", "usr1" and "SIGUSR1" are all "SIGUSR1"."""
    name = value.upper()
    return name if name.startswith("SIG") else f"SIG{name}"


def usable_preempt_signal(name: str | None) -> bool:
    import signal

    if name is None:
        return True
    name = signal_name(name)
    return name in signal.Signals.__members__ and name not in ("SIGKILL", "SIGSTOP", "SIGINT", "SIGTERM", "SIGCHLD")


def _check_preempt_signal(name: str | None) -> None:
    _check(usable_preempt_signal(name), "dist.preempt_signal", name, f"{PREEMPT_SIGNAL_RULE}, or null")


def check_loss_args(name: str, loss_args: Mapping[str, Any]) -> None:
    """``train.loss_args`` of a built-in ``train.loss``: nothing for "model", cross-entropy's three arguments with
    usable values (``train/losses.py`` builds it; a factory's arguments are checked there, against its signature)."""
    if name == "model":
        if loss_args:
            raise ConfigError(
                "train.loss_args is for a loss function, but train.loss=model: the model computes its loss."
            )
        return
    unknown = sorted(set(loss_args) - set(CROSS_ENTROPY_ARGS))
    if unknown:
        raise ConfigError(
            f"train.loss_args gives {', '.join(unknown)}, which train.loss=cross_entropy does not take (it takes "
            f"{', '.join(CROSS_ENTROPY_ARGS)}; the reduction is the batch mean, which the trainer needs). Remove it, "
            "or write a loss factory."
        )
    smoothing = loss_args.get("label_smoothing", 0.0)
    if not isinstance(smoothing, (int, float)) or isinstance(smoothing, bool) or not 0 <= smoothing <= 1:
        raise ConfigError(f"train.loss_args.label_smoothing={smoothing!r}: use a number from 0 to 1, e.g. 0.1.")
    weight = loss_args.get("weight", [1.0])
    numbers = isinstance(weight, (list, tuple)) and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0 for w in weight
    )
    if not numbers or not weight:
        raise ConfigError(
            f"train.loss_args.weight={weight!r}: give one weight >= 0 per class, as a list such as [1.0, 2.0, 0.5]."
        )
    index = loss_args.get("ignore_index", -100)
    if not isinstance(index, int) or isinstance(index, bool):
        raise ConfigError(f"train.loss_args.ignore_index={index!r}: use the integer target to ignore, e.g. -100.")


def check_global_batch(batch_size: int, world_size: int, key: str = "data.batch_size") -> None:
    """Raise ConfigError unless the global ``batch_size`` (named ``key`` in the message) gives every process a share:
    at least one sample each (the shares may be uneven: 64 over 3 processes is 22 + 21 + 21)."""
    if batch_size < max(1, world_size):
        raise ConfigError(
            f"{key}={batch_size} is the global batch, split over {world_size} processes: each needs at least one "
            f"sample of it; use {key}={world_size} or more, or run fewer processes."
        )


def check_sizes(train: Any, val: Any, batch_size: int, world_size: int, key: str = "data.batch_size") -> None:
    """Raise ConfigError for an empty split, a global batch smaller than the processes, or one too large. The splits
    are sized: map-style datasets, or ranges of their sizes."""
    check_global_batch(batch_size, world_size, key)
    for split, ds in (("training", train), ("validation", val)):
        if len(ds) == 0:
            fix = "check data.root and data.name" if key.startswith("data.") else "pass a dataset with samples"
            raise ConfigError(f"the {split} dataset is empty; {fix}.")
    if len(val) < world_size:
        raise ConfigError(
            f"the validation dataset has {len(val)} sample(s), fewer than the {world_size} processes that each "
            f"score a share of it; give it at least {world_size} (data.val_size for the built-in datasets), or run "
            "fewer processes."
        )
    per_process = math.ceil(len(train) / world_size)
    if math.ceil(batch_size / world_size) > per_process:
        raise ConfigError(
            f"{key}={batch_size} gives {math.ceil(batch_size / world_size)} samples per process, but each of the "
            f"{world_size} processes only has {per_process} training samples; lower {key}."
        )
