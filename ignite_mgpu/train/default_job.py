"""The default job: ``training(local_rank, cfg)`` wires data, model, optimizer, engines and handlers, top to bottom;
``scoring`` scores saved weights. Both run in every process that the launcher starts."""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.utils import manual_seed
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from ignite_mgpu import text
from ignite_mgpu.checkpoint.files import clean_stale_temp_files, find_resumable, weights_only_resume
from ignite_mgpu.checkpoint.load import load_checkpoint
from ignite_mgpu.checkpoint.resume import resume
from ignite_mgpu.checkpoint.same_run import run_signature
from ignite_mgpu.checkpoint.save import RunInfo, adopt_existing, writes_awaited
from ignite_mgpu.checkpoint.state import checkpoint_objects
from ignite_mgpu.config.loading import dump_config
from ignite_mgpu.config.schema import Config, best_metric
from ignite_mgpu.env import stop
from ignite_mgpu.env.clock import job_clock
from ignite_mgpu.env.cluster import outer_restarts
from ignite_mgpu.errors import TrainingInterrupted
from ignite_mgpu.parallel.strategy import model_devices, prepare_model
from ignite_mgpu.runs import folder
from ignite_mgpu.runs.closing import closing_lines, stopped_line
from ignite_mgpu.runs.folder import run_dir
from ignite_mgpu.train.allocator import frozen_heap, setup_cpu_memory
from ignite_mgpu.train.checkpointing import attach_checkpoints
from ignite_mgpu.train.data.datasets import example_inputs
from ignite_mgpu.train.data.loaders import attach_skip_counter, create_dataloaders
from ignite_mgpu.train.epoch_log import EpochLog, jsonable
from ignite_mgpu.train.evaluator import create_evaluator, validation_metrics
from ignite_mgpu.train.goodput import Goodput
from ignite_mgpu.train.losses import create_loss
from ignite_mgpu.train.models import create_model
from ignite_mgpu.train.optim import create_lr_scheduler, create_optimizer, optim_options
from ignite_mgpu.train.step.deterministic import use_deterministic_algorithms
from ignite_mgpu.train.step.trainer import Trainer, create_trainer
from ignite_mgpu.train.tracking.trackers import Trackers

logger = logging.getLogger("ignite_mgpu")


def setup_logging(rank: int) -> None:
    """One stderr handler per process; rank 0 logs INFO, the others only warnings, all tagged with the rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("ignite").setLevel(logging.WARNING)


def sharding(cfg: Config, world_size: int) -> bool:
    """Whether FSDP shards the model: ``--strategy fsdp`` with more than one process."""
    return cfg.dist.strategy == "fsdp" and world_size > 1


def fsdp_options(cfg: Config) -> dict[str, Any]:
    """``prepare_model``'s FSDP arguments from the config (ignored by the other strategies)."""
    m = cfg.model
    return {
        "fsdp_blocks": m.fsdp_blocks,
        "precision": cfg.train.precision,
        "cpu_offload": m.fsdp_cpu_offload,
        "reshard_after_forward": m.fsdp_reshard_after_forward,
    }


def training(local_rank: int, cfg: Config, restarts: int | None = None) -> None:
    """Train ``cfg`` in this process (one of ``idist.get_world_size()``), then say how it ended on rank 0.
    ``restarts``: how often the job was restarted before (None: as torchrun or SLURM say), for metrics.jsonl."""
    rank, world_size = idist.get_rank(), idist.get_world_size()
    out = start_process(cfg, rank, world_size)
    t = cfg.train
    built = build(cfg, out)
    train_loader, val_loader, model, optimizer = built.train_loader, built.val_loader, built.model, built.optimizer
    lr_scheduler, loss_fn, trainer = built.lr_scheduler, built.loss_fn, built.trainer
    metrics = validation_metrics(loss_fn, idist.device(), cfg.eval.metrics, cfg.eval.metric_args)
    parts = trainer.step.micro_batching  # the evaluation's parts follow the training's
    evaluator = create_evaluator(model, metrics, model_loss=loss_fn is None, precision=t.precision, micro_batch=parts)
    goodput = Goodput(out / folder.GOODPUT, job_clock(), writer=rank == 0)
    # Before the validation: an epoch's iterations end where its evaluation starts.
    goodput.attach(trainer)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(val_loader))

    # FSDP: gathered into plain state dicts.
    model_state, optimizer_state = checkpoint_objects(model, optimizer)
    to_save = {
        "model": model_state,
        "optimizer": optimizer_state,
        "lr_scheduler": lr_scheduler,
        "trainer": trainer,
        "scaler": trainer.step.scaler,  # fp16's GradScaler (a disabled one saves {})
        "run": RunInfo(world_size, cfg.data.batch_size, run_signature(cfg), functools.partial(_epoch_loss, trainer)),
    }
    restarts = outer_restarts() if restarts is None else restarts
    devices = model_devices(model)
    epoch_log = EpochLog(out / folder.METRICS, cfg.data.batch_size, evaluator, devices, restarts, goodput)
    epoch_log.attach(trainer)
    # The time in these handlers is the checkpoint stall.
    with goodput.timing_checkpoints(trainer, evaluator):
        full, best = attach_checkpoints(trainer, evaluator, to_save, cfg.checkpoint, out, best_metric(cfg))
    _attach_extras(cfg, trainer, rank)
    if cfg.resume:
        if not resume(cfg, to_save, world_size):
            return
        # From weights: a new run, no files yet.
        # The resumed epoch goes on from the loss sums of its first part (the guard reads them).
        trainer.state.resumed_epoch_loss = _resumed_epoch_loss(to_save["run"].loaded)  # type: ignore[attr-defined]
        if to_save["run"].loaded or not weights_only_resume(cfg.resume):
            adopt_existing(full, best, out, cfg.checkpoint.metric_mode)
            if rank == 0:
                # One row per epoch, also across restarts.
                epoch_log.drop_epochs_after(trainer.state.epoch)

    # The last write too.
    try:
        with Trackers(cfg, trainer, evaluator, optimizer, epoch_log, out), writes_awaited(full), frozen_heap():
            trainer.run(train_loader, max_epochs=t.epochs, epoch_length=t.epoch_length)
    except TrainingInterrupted as stopped:
        raise _with_checkpoint(stopped, cfg, out) from None
    if rank == 0:  # three lines for a person; the figures are in metrics.jsonl
        _say_finished(out, best.last_checkpoint, trainer.state.epoch, epoch_log)


@dataclass(frozen=True)
class Built:
    """What one training job is made of, built the same way by ``training`` and by ``ignite-mgpu scale``'s
    ``measuring``."""

    train_loader: DataLoader
    val_loader: DataLoader
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler
    loss_fn: Any
    trainer: Trainer


def build(cfg: Config, out: Path) -> Built:
    """The data, the model placed for the strategy, the optimizer, its schedule, the loss and the trainer (its step)
    of ``cfg``, in this process; ``out``: the run's folder (the remembered micro-batch size)."""
    t = cfg.train
    train_loader, val_loader = create_dataloaders(cfg.data, cfg.model.num_classes, cfg.seed)
    model = _create_model(cfg, train_loader)
    # After prepare_model: FSDP2's parameters are the sharded ones.
    optimizer = create_optimizer(model, **optim_options(cfg.optim))
    lr_scheduler = _create_lr_scheduler(cfg, optimizer, len(train_loader))
    loss_fn = create_loss(t.loss, t.loss_args)
    trainer = _create_trainer(cfg, model, optimizer, lr_scheduler, loss_fn, out)
    return Built(train_loader, val_loader, model, optimizer, lr_scheduler, loss_fn, trainer)


def _say_finished(out: Path, best_model: str | Path | None, epochs: int, epoch_log: EpochLog) -> None:
    # Where the step's time went, when something stands out (runs/bottleneck.py), before the three closing lines.
    if (verdict := epoch_log.verdict()) is not None and verdict.words:
        logger.warning("step time: %s", verdict.words)
    for line in closing_lines(out, best_model, epochs, epoch_log.last.get("run_time_s") or 0.0):
        logger.info(line)


def _with_checkpoint(stopped: TrainingInterrupted, cfg: Config, out: Path) -> TrainingInterrupted:
    """A stop (Ctrl-C, SIGTERM) that says which checkpoint it left and the command that goes on from it: the stop's
    own (``checkpoint.save_on_stop``: at the stop's iteration, written by rank 0, which every rank names without
    waiting for it), else the newest complete one."""
    if cfg.checkpoint.save_on_stop:
        suffix = "" if cfg.checkpoint.format == "sharded" else ".pt"
        saved: Path | None = out / f"checkpoint_{stopped.iteration}{suffix}"
    else:
        saved = find_resumable(out)
    return TrainingInterrupted(stopped.signum, stopped.iteration, stopped_line(out, saved))


def _epoch_loss(trainer: Engine) -> dict[str, Any]:
    """Saved in every checkpoint: the current epoch's loss sums (the guard's ``epoch_sums``: the global batch's mean
    losses summed, and the iterations) and the iteration they reach, so that an epoch resumed mid-way, on any number
    of processes, reports the whole epoch's train_loss."""
    total, iterations = getattr(trainer.state, "epoch_loss", (0.0, 0.0))
    return {"epoch_losses": [float(total), float(iterations), trainer.state.iteration]}


def _resumed_epoch_loss(saved: dict[str, Any]) -> list[float] | None:
    """The epoch's loss sums that a checkpoint's ``run`` entry carries, as ``_epoch_loss`` writes them; a checkpoint
    with ``epoch_loss`` instead summed every rank's losses and counted every rank's iterations: divided by its
    process count, they are the same sums."""
    if "epoch_losses" in saved:
        return list(saved["epoch_losses"])
    per_rank, world = saved.get("epoch_loss"), saved.get("world_size")
    if not per_rank or len(per_rank) != 3 or not world:
        return None
    return [per_rank[0] / world, per_rank[1] / world, per_rank[2]]


def _create_trainer(
    cfg: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: LRScheduler,
    loss_fn: Any,
    out: Path,
) -> Trainer:
    t = cfg.train
    return create_trainer(
        model,
        optimizer,
        loss_fn,
        precision=t.precision,
        grad_accum_steps=t.grad_accum_steps,
        clip_grad_norm=t.clip_grad_norm,
        lr_scheduler=lr_scheduler,
        deterministic=t.deterministic,
        check_every=t.check_every,
        checkpoint_every_iters=cfg.checkpoint.every_iters,
        checkpoint_every_minutes=cfg.checkpoint.every_minutes,
        micro_batch=t.micro_batch,
        micro_batch_file=out / folder.MICRO_BATCH,
    )


def start_process(cfg: Config, rank: int, world_size: int) -> Path:
    """This process's logging, allocator, seed and determinism; rank 0 writes the resolved config. Returns the
    run's folder."""
    setup_logging(rank)
    setup_cpu_memory(cfg.train.keep_cpu_memory, idist.device().type, sharded=sharding(cfg, world_size))
    manual_seed(cfg.seed)
    if cfg.train.deterministic:
        # Before anything runs on the GPU: cuBLAS reads its setting when it starts.
        use_deterministic_algorithms()
    elif idist.device().type == "cuda":
        # Fixed-size inputs: cuDNN picks its fastest kernels once.
        torch.backends.cudnn.benchmark = True
    out = run_dir(cfg.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / folder.CONFIG).write_text(dump_config(cfg))
        clean_stale_temp_files(out)
    logger.info("world size %d, backend %s, device %s", world_size, idist.backend(), idist.device())
    return out


def _create_model(cfg: Config, loader: DataLoader) -> nn.Module:
    """The configured model, built (lazy layers materialised on one sample) and placed for the strategy."""
    m = cfg.model
    model = create_model(m, example_inputs(loader.dataset, loader.collate_fn))
    stop.note_waypoint()  # next, wrapping waits for every rank (DDP's broadcast): the hang watch sees who is late
    return prepare_model(model, cfg.dist.strategy, m.sync_batchnorm, m.compile, **fsdp_options(cfg))


def _create_lr_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, loader_length: int) -> LRScheduler:
    """``optim.scheduler`` after ``optim.warmup_epochs``, stepped once per optimizer step (accumulation windows)."""
    t, o = cfg.train, cfg.optim
    # Windows per epoch.
    steps_per_epoch = math.ceil((t.epoch_length or loader_length) / t.grad_accum_steps)
    total_steps, warmup_steps = math.ceil(steps_per_epoch * t.epochs), round(steps_per_epoch * o.warmup_epochs)
    return create_lr_scheduler(
        optimizer, total_steps, warmup_steps, scheduler=o.scheduler, scheduler_args=o.scheduler_args
    )


def _attach_extras(cfg: Config, trainer: Engine, rank: int) -> None:
    """The optional handlers: the count of skipped images and the progress bar (rank 0)."""
    t = cfg.train
    if cfg.data.skip_bad_samples:
        attach_skip_counter(trainer)
    if t.progress_bar and rank == 0 and sys.stderr.isatty():
        from ignite.handlers import ProgressBar

        every = Events.ITERATION_COMPLETED(every=t.check_every or 10)
        ProgressBar(persist=False).attach(trainer, event_name=every, state_attributes=["running_loss"])


def scoring(local_rank: int, cfg: Config, checkpoint_path: str, as_json: bool) -> None:
    """Score the weights in ``checkpoint_path`` on the validation split (metrics reduced over all ranks); what
    every process of ``ignite-mgpu evaluate`` runs (``jobs.evaluate`` checks and launches it)."""
    rank = idist.get_rank()
    setup_logging(rank)
    setup_cpu_memory(cfg.train.keep_cpu_memory, idist.device().type, sharded=sharding(cfg, idist.get_world_size()))
    _, val_loader = create_dataloaders(cfg.data, cfg.model.num_classes, cfg.seed)
    model = create_model(cfg.model, example_inputs(val_loader.dataset, val_loader.collate_fn))
    load_checkpoint(checkpoint_path, {"model": model}, map_location="cpu")
    # As training: never a silent DataParallel.
    model = prepare_model(model, cfg.dist.strategy, **fsdp_options(cfg))
    loss_fn = create_loss(cfg.train.loss, cfg.train.loss_args)
    metrics = validation_metrics(loss_fn, idist.device(), cfg.eval.metrics, cfg.eval.metric_args)
    evaluator = create_evaluator(model, metrics, model_loss=loss_fn is None, precision=cfg.train.precision)
    state = evaluator.run(val_loader)
    scores = {name: value for name, v in state.metrics.items() if (value := jsonable(v)) is not None}
    samples = len(val_loader.dataset)  # type: ignore[arg-type]  # a map-style dataset: torch's type has no len
    result = {"checkpoint": checkpoint_path, "samples": samples, **scores}
    if rank == 0:
        print(json.dumps(result) if as_json else "  ".join(f"{k}: {text.score(v)}" for k, v in result.items()))
