"""The default job: ``training(local_rank, cfg)`` wires data, model, optimizer, engines and handlers, top to
bottom; ``evaluation`` scores saved weights. Both run in every process that the launcher starts."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, global_step_from_engine
from ignite.metrics import Accuracy, Loss
from ignite.utils import manual_seed
from torch import nn

from ignite_mgpu import checkpoint as ckpt
from ignite_mgpu.allocator import keep_freed_memory
from ignite_mgpu.config import Config, dump_config
from ignite_mgpu.data import create_dataloaders
from ignite_mgpu.engine import (
    create_evaluator,
    create_lr_scheduler,
    create_optimizer,
    create_trainer,
    prepare_model,
    unwrap,
)
from ignite_mgpu.handlers import EpochReport, GuardEvents, create_checkpointers
from ignite_mgpu.models import create_model

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


def model_devices(model: nn.Module) -> list[torch.device]:
    """The devices a model runs on: every GPU of a DataParallel, else the device of its parameters."""
    if isinstance(model, nn.DataParallel):
        return [torch.device("cuda", i) for i in model.device_ids]
    return [next(model.parameters()).device]


# Keys that may change between an interrupted run and its resumption without making it another run.
_RESUMABLE_CHANGES = (
    "resume",
    "output_dir",
    "train.epochs",
    "train.progress_bar",
    "train.tensorboard",
    "train.check_every",
    "train.keep_cpu_memory",
    "data.num_workers",
    "data.download",
    "data.root",
    "dist.",
    "checkpoint.",
)


def run_signature(cfg: Config) -> dict[str, str]:
    """The config keys that define a run, flattened ("optim.lr" -> "0.05"); compared on resume."""
    from omegaconf import OmegaConf

    def flat(node: Any, prefix: str = "") -> dict[str, str]:
        if isinstance(node, dict):
            return {k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix[:-1]: str(node)}

    everything = flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    return {k: v for k, v in everything.items() if not k.startswith(_RESUMABLE_CHANGES)}


def setup_cpu_memory(keep: bool) -> None:
    """On the CPU, let glibc keep freed memory for the next step (``keep_freed_memory``) and say what was done."""
    if not keep or idist.device().type != "cpu":
        return
    why_not = keep_freed_memory()
    if why_not is None:
        logger.info("CPU memory: freed memory is kept for the next step (glibc mallopt; train.keep_cpu_memory)")
    else:
        logger.info("CPU memory: malloc left as configured: %s", why_not)


def training(local_rank: int, cfg: Config) -> None:
    """Train ``cfg`` in this process (one of ``idist.get_world_size()``), then print a summary on rank 0."""
    rank, world_size = idist.get_rank(), idist.get_world_size()
    setup_logging(rank)
    setup_cpu_memory(cfg.train.keep_cpu_memory)
    manual_seed(cfg.seed)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, at the first matmul
        torch.use_deterministic_algorithms(True)
    out = Path(cfg.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_config(cfg))
        ckpt.clean_stale_temp_files(out)
    logger.info("world size %d, backend %s, device %s", world_size, idist.backend(), idist.device())

    train_loader, val_loader = create_dataloaders(cfg.data, cfg.model.num_classes, cfg.seed)
    example = train_loader.dataset[0][0].unsqueeze(0)  # type: ignore[index]  # map-style (image, label)
    m = cfg.model
    model = prepare_model(create_model(m, example), cfg.dist.strategy, m.sync_batchnorm, m.compile)
    o, t = cfg.optim, cfg.train
    optimizer = create_optimizer(model, o.name, o.lr, o.momentum, o.weight_decay)
    steps_per_epoch = (t.epoch_length or len(train_loader)) / t.grad_accum_steps
    scheduler = create_lr_scheduler(
        optimizer,
        math.ceil(steps_per_epoch * t.epochs),
        round(steps_per_epoch * o.warmup_epochs),
        o.scheduler == "cosine",
    )
    trainer = create_trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        precision=t.precision,
        grad_accum_steps=t.grad_accum_steps,
        clip_grad_norm=t.clip_grad_norm,
        lr_scheduler=scheduler,
        deterministic=t.deterministic,
        check_every=t.check_every,
        checkpoint_every=cfg.checkpoint.every_iters,
    )
    metrics = {"accuracy": Accuracy(), "loss": Loss(nn.CrossEntropyLoss())}
    evaluator = create_evaluator(model, metrics, precision=t.precision)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(val_loader))

    run_info = ckpt.RunInfo(world_size, cfg.data.batch_size, run_signature(cfg))
    to_save = {
        "model": unwrap(model),
        "optimizer": optimizer,
        "lr_scheduler": scheduler,
        "trainer": trainer,
        "scaler": getattr(trainer, "scaler"),  # noqa: B009 - an attribute create_trainer adds to the Engine
        "run": run_info,
    }
    report = EpochReport(out / "metrics.jsonl", cfg.data.batch_size, evaluator, model_devices(model))
    report.attach(trainer)
    full, best = attach_checkpoints(trainer, evaluator, to_save, cfg)
    if cfg.data.skip_bad_samples:
        attach_skip_counter(trainer)
    if t.tensorboard and rank == 0:
        attach_tensorboard(trainer, report, out / "tb")
    if t.progress_bar and rank == 0 and sys.stderr.isatty():
        from ignite.handlers import ProgressBar

        ProgressBar(persist=False).attach(
            trainer, event_name=Events.ITERATION_COMPLETED(every=t.check_every or 10), state_attributes=["running_loss"]
        )
    if cfg.resume:
        if not resume(cfg, to_save, world_size):
            return
        ckpt.adopt_existing(full, best, cfg.output_dir)
    trainer.run(train_loader, max_epochs=t.epochs, epoch_length=t.epoch_length)
    if rank == 0:
        summary = report.last | {"best_model": str(best.last_checkpoint) if best.last_checkpoint else None}
        logger.info("finished: %s", json.dumps(summary))


def attach_checkpoints(
    trainer: Engine, evaluator: Engine, to_save: dict[str, Any], cfg: Config
) -> tuple[Checkpoint, Checkpoint]:
    """Full state every N epochs / iterations and on a stop signal; the best unwrapped model after validation."""
    c = cfg.checkpoint
    full, best = create_checkpointers(
        to_save, to_save["model"], cfg.output_dir, c.n_saved, c.metric, global_step_from_engine(trainer)
    )
    if c.every:
        trainer.add_event_handler(Events.EPOCH_COMPLETED(every=c.every), full)
    if c.every_iters:
        # The guard also checks on these iterations (create_trainer's checkpoint_every), so no save follows an
        # unchecked NaN.
        trainer.add_event_handler(Events.ITERATION_COMPLETED(every=c.every_iters), full)
    if c.save_on_stop:
        trainer.add_event_handler(GuardEvents.STOPPING, full)
    evaluator.add_event_handler(Events.COMPLETED, best)
    return full, best


def attach_skip_counter(trainer: Engine) -> None:
    """Count the unreadable images skipped in each epoch over all ranks (the collate function reports them)."""
    skipped = [0]

    def count(engine: Engine) -> None:
        skipped[0] += int(engine.state.batch[2])  # type: ignore[index]  # the skip collate adds a 3rd entry

    def report(engine: Engine) -> None:
        total = int(idist.all_reduce(torch.tensor(skipped[0])))
        skipped[0] = 0
        if total:
            logger.warning(
                "epoch %d: skipped %d unreadable images (data.skip_bad_samples=true)", engine.state.epoch, total
            )

    trainer.add_event_handler(Events.ITERATION_COMPLETED, count)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, report)


def attach_tensorboard(trainer: Engine, report: EpochReport, logdir: Path) -> None:
    """Every number of the epoch report as a TensorBoard scalar (rank 0; needs the tensorboard package)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(logdir))

    def write(engine: Engine) -> None:
        for key, value in report.last.items():
            if isinstance(value, (int, float)) and key not in ("epoch", "iteration"):
                writer.add_scalar(key, value, engine.state.epoch)
        writer.flush()

    trainer.add_event_handler(Events.EPOCH_COMPLETED, write)
    trainer.add_event_handler(Events.COMPLETED, lambda: writer.close())


def resume(cfg: Config, to_save: dict[str, Any], world_size: int) -> bool:
    """Restore every object from ``cfg.resume`` (a path, or "auto": the newest complete checkpoint).

    Returns False when the checkpoint already finished ``train.epochs`` (nothing left to train).
    """
    path = ckpt.find_resumable(cfg.output_dir) if cfg.resume == "auto" else Path(str(cfg.resume))
    if path is None:
        raise ckpt.CheckpointError(f"--resume auto: no complete checkpoint in {cfg.output_dir}.")
    now = run_signature(cfg)

    def same_run(checkpoint: dict[str, Any]) -> None:  # runs before anything is loaded
        saved = checkpoint.get("run", {}).get("config", {})
        changed = [f"{k}: {v} -> {now.get(k, 'absent')}" for k, v in saved.items() if v != now.get(k, "absent")]
        if changed and not cfg.checkpoint.allow_config_change:
            raise ckpt.CheckpointError(
                f"{path} belongs to a run with other settings ({'; '.join(changed[:5])}"
                f"{'; ...' if len(changed) > 5 else ''}). Resume with the same settings, use a new --output-dir, "
                "or pass checkpoint.allow_config_change=true to resume anyway."
            )

    ckpt.load_checkpoint(path, to_save, check=same_run)
    saved = to_save["run"].loaded
    logger.info("resumed from %s at iteration %d", path, to_save["trainer"].state.iteration)
    if saved.get("world_size", world_size) != world_size:
        logger.warning(
            "checkpoint was written with %d processes, resuming with %d: the global batch stays %d, each process "
            "now takes %d per step; the resumed epoch restarts its data order for the new process count",
            saved["world_size"],
            world_size,
            cfg.data.batch_size,
            cfg.data.batch_size // world_size,
        )
    state = to_save["trainer"].state
    if state.epoch >= cfg.train.epochs and state.iteration % state.epoch_length == 0:
        logger.warning(
            "%s already finished %d epochs (train.epochs=%d): nothing to train; raise train.epochs to "
            "continue training",
            path,
            state.epoch,
            cfg.train.epochs,
        )
        return False
    return True


def evaluation(local_rank: int, cfg: Config, checkpoint_path: str, as_json: bool) -> None:
    """Score the weights in ``checkpoint_path`` on the validation split (metrics reduced over all ranks)."""
    rank = idist.get_rank()
    setup_logging(rank)
    setup_cpu_memory(cfg.train.keep_cpu_memory)
    _, val_loader = create_dataloaders(cfg.data, cfg.model.num_classes, cfg.seed)
    model = create_model(cfg.model, val_loader.dataset[0][0].unsqueeze(0))  # type: ignore[index]  # map-style
    ckpt.load_checkpoint(checkpoint_path, {"model": model}, map_location="cpu")
    model = prepare_model(model, cfg.dist.strategy)  # as training places it: never a silent DataParallel
    metrics = {"accuracy": Accuracy(), "loss": Loss(nn.CrossEntropyLoss())}
    state = create_evaluator(model, metrics, precision=cfg.train.precision).run(val_loader)
    result = {"checkpoint": checkpoint_path, "samples": len(val_loader.dataset), **state.metrics}  # type: ignore[arg-type]  # sized
    if rank == 0:
        print(json.dumps(result) if as_json else "  ".join(f"{k}: {v}" for k, v in result.items()))
