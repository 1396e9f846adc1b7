"""The configuration's schema: one dataclass per YAML section (a real type, a default, and a one-line comment that
becomes the docs reference), the closed choices beside their ``Literal`` types, and what a config implies (its run
folder, its best-model metric, its trackers). Torch-free, and OmegaConf-free: ``ignite-mgpu --help`` reads it.

Loading and dumping is ``config.loading``; the value and combination checks are ``config.checks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ignite_mgpu.runs import metric_names

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
GENERATED = ("synthetic", "fake")  # made in memory; their sizes are in the config
# The built-in models, optimizers and schedules by name: a config that names only these (and gives them no extra
# arguments) is checked without importing torch in the launching process.
MODELS = ("simple_cnn", "mlp")  # besides any torchvision.models name and "package.module:factory"
OPTIMIZERS = ("sgd", "adamw")  # besides any torch.optim class and "package.module:factory"
SCHEDULES = ("cosine", "constant")  # besides any torch.optim.lr_scheduler class and "package.module:factory"


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
    num_workers: int | Literal["auto"] = 0  # loader workers per node, split over its processes; auto: spare CPUs
    shuffle: bool = True  # shuffle the training set every epoch (seeded)
    image_size: int = 32  # side of the images; every dataset is resized to it
    train_size: int = 4096  # samples in the synthetic/fake training split
    val_size: int = 1000  # samples in the synthetic/fake validation split
    skip_bad_samples: bool = False  # imagefolder: skip unreadable images (counted) instead of failing


@dataclass
class OptimConfig:
    """`optim:` optimizer, parameter groups and learning-rate schedule."""

    name: str = "sgd"  # sgd (Nesterov unless optim.nesterov=false), adamw, a torch.optim class (Adam, adam), a factory
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
    micro_batch: int | Literal["auto"] | None = None  # N: each process's batch in parts of N; auto: smaller on OOM
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
    async_save: bool = True  # snapshot the state in the step (into CPU memory), write it in the background


@dataclass
class DistConfig:
    """`dist:` processes, GPUs and rendezvous (the CLI flags --nproc, --gpus, ... set these)."""

    nproc: int | None = None  # processes on this node (None = number of selected GPUs, or 1 on CPU)
    backend: Backend = "auto"  # auto = nccl when CUDA is available, else gloo
    gpus: str | None = None  # "all", "none", "auto", "auto:N", "auto:MIN-MAX", physical ids "2,3" (None: as exported)
    strategy: Strategy = "ddp"  # ddp: a process per GPU; dp: one, DataParallel; fsdp: sharded
    nnodes: int = 1  # machines in the job
    node_rank: int = 0  # this machine's index, 0..nnodes-1
    master_addr: str = "127.0.0.1"  # address of node 0 (multi-node, or with an explicit master_port)
    master_port: int | None = None  # TCP port on node 0 (None on one node = a private file rendezvous, no port)
    timeout: float = 300.0  # seconds any collective of any of the job's process groups may wait, set-up included
    stop_grace: float = 60.0  # seconds workers get to checkpoint and exit after SIGTERM/Ctrl-C
    hang_seconds: float = 60.0  # hung: silent max(this, 10 x slowest step); 2 x this if a first batch is late (0: off)
    cpu_binding: CpuBinding = "none"  # CPUs and threads of each process (cpus/binding.py)
    max_restarts: int = 0  # restart the processes after a curable failure, from the newest complete checkpoint
    preempt_signal: str | None = "SIGUSR1"  # SLURM's time-limit warning: checkpoint, requeue the job, exit (null: off)
    share: bool = False  # run on GPUs that other jobs claim, and claim none (gpus/claims.py)
    wait: float | None = None  # seconds to wait until the GPUs are free (.inf: no limit); null: refuse at once
    min_free_memory: float = 0.9  # with wait: a GPU is free when this share of its memory is (and nobody has it)
    rank_prefix: bool = False  # each line a process writes begins with its rank: [rank1]: (as torchrun --tee)


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


def best_metric(cfg: Config) -> str:
    """The validation metric that picks best_model_*.pt: checkpoint.metric, or accuracy where it is reported."""
    return cfg.checkpoint.metric or metric_names.default_best(metric_names.reported(cfg.eval.metrics, cfg.train.loss))


def trackers_of(t: TrainConfig) -> list[str]:
    """The experiment trackers of a run: train.loggers, and tensorboard for train.tensorboard=true; each once."""
    return list(dict.fromkeys([*t.loggers, *(["tensorboard"] if t.tensorboard else [])]))
