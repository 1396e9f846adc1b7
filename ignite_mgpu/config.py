"""Configuration: one dataclass per YAML section, loaded and validated by OmegaConf structured configs (imported
when a config is loaded: the dataclasses and the choices are read by ``ignite-mgpu --help``, which stays fast).

Precedence is fixed: dataclass defaults < ``--config FILE.yaml`` < dotted overrides (``optim.lr=0.05``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from ignite_mgpu import text
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs import folder, metric_names

# The closed choices, each written once: the dataclasses' types, the CLI's click.Choice and the checks read these.
Backend = Literal["auto", "nccl", "gloo"]
Strategy = Literal["ddp", "dp", "fsdp"]
CpuBinding = Literal["auto", "none", "cores", "numa"]
Precision = Literal["fp32", "bf16", "fp16"]
Tracker = Literal["tensorboard", "mlflow", "wandb", "csv"]
BACKENDS: tuple[str, ...] = get_args(Backend)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
CPU_BINDINGS: tuple[str, ...] = get_args(CpuBinding)
PRECISIONS: tuple[str, ...] = get_args(Precision)
TRACKERS: tuple[str, ...] = get_args(Tracker)
DATASETS = ("synthetic", "fake", "mnist", "fashion_mnist", "cifar10", "imagefolder")  # or "package.module:factory"
DATASETS_ON_DISK = ("mnist", "fashion_mnist", "cifar10", "imagefolder")  # read from data.root


@dataclass
class ModelConfig:
    """`model:` which network to build."""

    name: str = "simple_cnn"  # built-in name, any torchvision.models name (resnet18), or "package.module:factory"
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the model's constructor
    num_classes: int = 10  # size of the classifier output (passed to constructors that take num_classes)
    sync_batchnorm: bool = False  # convert BatchNorm to SyncBatchNorm (DDP only)
    compile: bool = False  # wrap the model with torch.compile
    fsdp_blocks: list[str] | None = None  # fsdp: class names of the blocks sharded one by one; None: the default rule
    fsdp_cpu_offload: bool = False  # fsdp: sharded parameters, gradients and optimizer state in CPU memory (CUDA)
    fsdp_reshard_after_forward: bool = True  # fsdp: free a block's gathered parameters after its forward


@dataclass
class DataConfig:
    """`data:` which dataset, and how it is batched and loaded."""

    name: str = "synthetic"  # synthetic, fake, mnist, fashion_mnist, cifar10, imagefolder, or "package.module:factory"
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of a dataset factory
    root: str | None = None  # dataset folder; required for all but synthetic/fake (imagefolder: root/train, root/val)
    download: bool = False  # let torchvision download mnist/fashion_mnist/cifar10 into root
    batch_size: int = 128  # GLOBAL batch: split evenly across all processes
    num_workers: int | Literal["auto"] = 0  # loader workers per node, split over its processes; auto: train/loaders.py
    shuffle: bool = True  # shuffle the training set every epoch (seeded)
    image_size: int = 32  # side of the images; every dataset is resized to it
    train_size: int = 4096  # samples in the synthetic/fake training split
    val_size: int = 1000  # samples in the synthetic/fake validation split
    skip_bad_samples: bool = False  # imagefolder: skip unreadable images (counted) instead of failing


@dataclass
class OptimConfig:
    """`optim:` optimizer, parameter groups and learning-rate schedule."""

    name: str = "sgd"  # sgd (Nesterov unless optim.nesterov=false), adamw, a torch.optim class (Adam), or a factory
    lr: float = 0.05  # peak learning rate for the global batch (every optimizer gets it)
    momentum: float = 0.9  # to every optimizer with a momentum parameter (sgd, SGD, RMSprop); the others ignore it
    nesterov: bool = True  # sgd: Nesterov momentum; false: classic momentum, torch.optim.SGD's default (momentum > 0)
    weight_decay: float = 5e-4  # L2 penalty (decoupled for AdamW); every optimizer that takes weight_decay gets it
    args: dict[str, Any] = field(default_factory=dict)  # more keyword arguments of the optimizer (betas, eps, ...)
    no_decay_norm_and_bias: bool = False  # weight_decay 0 for biases, normalisation layers and every 1-d parameter
    param_groups: str | None = None  # "package.module:factory": model -> torch parameter groups; None: one group
    scheduler: str = "cosine"  # cosine, constant, a torch.optim.lr_scheduler class (OneCycleLR), or a factory
    scheduler_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of that scheduler class/factory
    warmup_epochs: float = 0.2  # linear warm-up length in epochs before the schedule (0 = none)


@dataclass
class TrainConfig:
    """`train:` the training loop."""

    epochs: int = 2  # passes over the training set
    loss: str = "cross_entropy"  # cross_entropy, model (the model returns its loss), or "package.module:factory"
    loss_args: dict[str, Any] = field(default_factory=dict)  # the loss's arguments (label_smoothing, weight, ...)
    precision: Precision = "fp32"  # bf16/fp16 autocast; fp16 uses a GradScaler (CUDA only)
    grad_accum_steps: int = 1  # micro-batches per optimizer step; DDP all-reduces only on the last one
    clip_grad_norm: float | None = None  # max global gradient norm (None = no clipping)
    deterministic: bool = False  # DeterministicEngine + torch.use_deterministic_algorithms: bitwise resume
    epoch_length: int | None = None  # iterations per epoch (None = one full pass over the data)
    check_every: int = 0  # iterations between the collective non-finite-loss / stop checks; 0: about once a second
    progress_bar: bool = True  # tqdm progress bar on rank 0
    tensorboard: bool = False  # the same as "tensorboard" in train.loggers: TensorBoard scalars in output_dir/tb
    loggers: list[Tracker] = field(default_factory=list)  # experiment trackers on rank 0: tensorboard mlflow wandb csv
    log_every: int = 50  # iterations between the trackers' training loss and learning rate points
    logger_args: dict[str, dict[str, Any]] = field(default_factory=dict)  # per tracker, e.g. {mlflow: {experiment: x}}
    keep_cpu_memory: bool = True  # CPU, Linux: glibc keeps freed memory for the next step (no page fault per tensor)


@dataclass
class EvalConfig:
    """`eval:` the validation metrics, reported after every epoch (val_<name>) and by ignite-mgpu evaluate."""

    metrics: list[str] | None = (
        None  # loss, accuracy, top<k>, perplexity, precision, recall, f1, pkg.mod:factory; null: loss (+accuracy if CE)
    )
    metric_args: dict[str, dict[str, Any]] = field(default_factory=dict)  # by metric name: a factory's, perplexity's


@dataclass
class CheckpointConfig:
    """`checkpoint:` what is saved into output_dir, and when."""

    every: int = 1  # save the full training state every N epochs (0 = never)
    every_iters: int = 0  # also save every N iterations (0 = off)
    every_minutes: float | None = None  # also save about every N minutes of training (null = off)
    n_saved: int = 2  # how many full checkpoints to keep
    metric: str | None = None  # picks best_model_*.pt: a name of eval.metrics; None: accuracy if reported, else loss
    metric_mode: Literal["auto", "max", "min"] = "auto"  # max/min: which way checkpoint.metric is better; auto: known
    save_on_stop: bool = True  # on SIGTERM/SIGINT write one checkpoint before exiting
    allow_config_change: bool = False  # let --resume continue a checkpoint written with other settings
    format: Literal["full", "sharded"] = "full"  # full: one file, written by rank 0; sharded: a folder, by every rank
    best_format: Literal["pt", "safetensors"] = "pt"  # the best model's file: a torch.save state_dict, or safetensors


@dataclass
class DistConfig:
    """`dist:` processes, GPUs and rendezvous (the CLI flags --nproc, --gpus, ... set these)."""

    nproc: int | None = None  # processes on this node (None = number of selected GPUs, or 1 on CPU)
    backend: Backend = "auto"  # auto = nccl when CUDA is available, else gloo
    gpus: str | None = None  # "all", "none", "auto", "auto:N", or physical ids "2,3" (None = current environment)
    strategy: Strategy = "ddp"  # ddp: a process per GPU; dp: one, DataParallel; fsdp: sharded
    nnodes: int = 1  # machines in the job
    node_rank: int = 0  # this machine's index, 0..nnodes-1
    master_addr: str = "127.0.0.1"  # address of node 0 (multi-node, or with an explicit master_port)
    master_port: int | None = None  # TCP port on node 0 (None on one node = a private file rendezvous, no port)
    timeout: float = 300.0  # seconds any collective may wait after the first iteration
    stop_grace: float = 60.0  # seconds workers get to checkpoint and exit after SIGTERM/Ctrl-C
    cpu_binding: CpuBinding = "none"  # CPUs and threads of each process (processes/binding.py)
    max_restarts: int = 0  # restart the processes after a curable failure, from the newest complete checkpoint
    preempt_signal: str | None = "SIGUSR1"  # SLURM's time-limit warning: checkpoint, requeue the job, exit (null: off)
    share: bool = False  # run on GPUs that other jobs claim, and claim none (processes/claims.py)
    wait: float | None = None  # seconds to wait until the GPUs are free (.inf: no limit); null: refuse at once
    min_free_memory: float = 0.9  # with wait: a GPU is free when this share of its memory is (and nobody has it)


@dataclass
class Config:
    """The whole run: one section per YAML top-level key, plus seed, output_dir and resume."""

    seed: int = 0  # seeds the data order, the model initialisation and the synthetic data
    output_dir: str | None = None  # config.yaml, metrics.jsonl, checkpoints; None: a new folder under runs/
    resume: str | None = None  # checkpoint path, or "auto" for the newest loadable one in output_dir
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)


def _paragraph(err: Exception, where: str) -> str:
    lines = str(err).splitlines()
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.strip().startswith("full_key:")), None)
    head = f"config key '{key}'" if key else "config"
    msg = lines[0] if lines[0].endswith((".", "?")) else lines[0] + "."
    return f"{head} ({where}): {msg} See `ignite-mgpu train --help` and configs/default.yaml for valid keys."


def dotted_keys() -> list[str]:
    """Every key as written on the command line (``train.epochs``), in the dataclasses' order."""
    return text.dotted(text.sections_of(Config()))


def _check_keys(layer: Any, where: str, overrides: list[str] | tuple[str, ...]) -> None:
    """Unknown keys of one layer (a YAML file, the overrides), down to the sections' keys: ``model.args`` and
    ``data.args`` take any key. The message suggests the key meant (``text.unknown_key``)."""
    sections = text.sections_of(Config())
    for key, value in layer.items():
        if key in sections and key != "":
            for sub in value if isinstance(value, dict) else ():
                if sub not in sections[key]:
                    raise ConfigError(text.unknown_key(f"{key}.{sub}", where, sections, overrides))
        elif key not in sections[""]:
            raise ConfigError(text.unknown_key(str(key), where, sections, overrides))


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build the run's `Config`: dataclass defaults, then the YAML file at ``path``, then dotted ``overrides``.

    Raises:
        ConfigError: unknown key (with the closest key of any section), wrong type, bad value, unreadable YAML.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(Config)
    layers: list[tuple[Any, str]] = []
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(
                f"--config {path}: no such file. Pass the path of a YAML file such as configs/debug.yaml."
            )
        try:
            layers.append((OmegaConf.load(file), f"from {path}"))  # yaml.SafeLoader underneath: no code runs
        except Exception as err:  # yaml.YAMLError and friends: report the file, not a traceback
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"--config {path}: not valid YAML ({first}). Fix the file's syntax.") from None
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"override '{bad[0]}' is not of the form key=value, e.g. optim.lr=0.05 or train.epochs=3.")
    if overrides:
        try:
            layers.append((OmegaConf.from_dotlist(list(overrides)), "from the command line"))
        except OmegaConfBaseException as err:
            raise ConfigError(_paragraph(err, "from the command line")) from None
    merged = schema
    for layer, where in layers:
        _check_keys(OmegaConf.to_container(layer), where, overrides)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise ConfigError(_paragraph(err, where)) from None
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]  # to_object returns the dataclass
    validate(cfg)
    return cfg


def _check(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r} is invalid: {rule}.")


def validate(cfg: Config) -> None:
    """Check value ranges and combinations that the types alone cannot express. Runs in the parent, before
    spawning; what needs the file system (``data.root``, the output folder) is the pre-flight's (preflight.py)."""
    _check_data(cfg.data, cfg.model)
    _check_optim(cfg.optim)
    _check_train(cfg.train, cfg.checkpoint)
    _check_dist(cfg.dist)
    _check_strategy_options(cfg)
    _check_names(cfg)


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
    for key, name in (("optim.name", o.name), ("optim.scheduler", o.scheduler)):  # that it exists: the pre-flight's
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
        t.loss in ("cross_entropy", "model") or ":" in t.loss,
        "train.loss",
        t.loss,
        "use cross_entropy, model (the model's forward returns its loss), or 'package.module:factory' for a factory "
        "that returns a loss function",
    )
    if t.loss_args and t.loss == "model":
        raise ConfigError("train.loss_args is for a loss function, but train.loss=model: the model computes its loss.")
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


def run_dir(cfg: Config) -> Path:
    """Where the run writes: ``output_dir``. ``fit`` and the CLI give a run without one a new folder under runs/
    before it starts; ``training`` called directly (``launch(training, cfg)``) writes to runs/default."""
    return folder.run_dir(cfg.output_dir)


def best_metric(cfg: Config) -> str:
    """The validation metric that picks best_model_*.pt: checkpoint.metric, or accuracy where it is reported."""
    return cfg.checkpoint.metric or metric_names.default_best(metric_names.reported(cfg.eval.metrics, cfg.train.loss))


def trackers_of(t: TrainConfig) -> list[str]:
    """The experiment trackers of a run: train.loggers, and tensorboard for train.tensorboard=true; each once."""
    return list(dict.fromkeys([*t.loggers, *(["tensorboard"] if t.tensorboard else [])]))


def _check_preempt_signal(name: str | None) -> None:
    import signal

    usable = name is None or (
        name in signal.Signals.__members__ and name not in ("SIGKILL", "SIGSTOP", "SIGINT", "SIGTERM", "SIGCHLD")
    )
    _check(
        usable,
        "dist.preempt_signal",
        name,
        "name a signal that a process can catch and that does not already mean stop, such as SIGUSR1 or SIGUSR2 "
        "(what sbatch --signal=USR1@90 sends), or null",
    )


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML (written to output_dir/config.yaml by rank 0)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
