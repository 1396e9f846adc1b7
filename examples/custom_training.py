"""Your own model and dataset with ignite-mgpu's engine factory, on 2 processes (CPU/gloo here, GPUs/nccl there).

    python examples/custom_training.py --nproc 2 --epochs 3

Only the public API is used: launch, create_dataloader, prepare_model, create_trainer, create_evaluator,
load_checkpoint, keep_freed_memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.engine import Events
from ignite.handlers import Checkpoint, DiskSaver
from ignite.metrics import Accuracy, Loss
from torch import nn
from torch.utils.data import TensorDataset

from ignite_mgpu import (
    create_dataloader,
    create_evaluator,
    create_trainer,
    keep_freed_memory,
    launch,
    load_checkpoint,
    prepare_model,
)


def make_data(n: int, seed: int) -> TensorDataset:
    """Points in the plane, labelled by whether they lie inside a circle: not linearly separable."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 2 - 1
    label = (x.norm(dim=1) < 0.7).long()
    return TensorDataset(x, label)


def run(local_rank: int, args: argparse.Namespace) -> None:
    """Runs in every process: idist knows the rank, world size and device."""
    if idist.device().type == "cpu":
        keep_freed_memory()  # glibc keeps freed tensors' memory for the next step: no page faults per step
    torch.manual_seed(args.seed)
    train_ds, val_ds = make_data(args.samples, seed=1), make_data(512, seed=2)
    rank = idist.get_rank()
    # batch_size is the global batch (each of N processes loads its share of 64, weighted by the trainer when N does
    # not divide it); the training order is seeded and changes every epoch, the same global batches on any N;
    # validation scores every sample on exactly one process.
    train_loader = create_dataloader(train_ds, 64, train=True, seed=args.seed)
    val_loader = create_dataloader(val_ds, 256, train=False)

    net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    model = prepare_model(net)  # DDP when there are several processes (strategy="dp": DataParallel)
    optimizer = idist.auto_optim(torch.optim.AdamW(model.parameters(), lr=0.01))
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss(), clip_grad_norm=1.0)
    evaluator = create_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(nn.CrossEntropyLoss())})

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        metrics = evaluator.run(val_loader).metrics
        if rank == 0:
            print(
                f"epoch {engine.state.epoch}: train_loss {engine.state.metrics['train_loss']:.4f} "
                f"val_accuracy {metrics['accuracy']:.4f}",
                flush=True,
            )

    # ignite's Checkpoint unwraps DDP, so the file loads into the plain `net` (rank 0 writes it).
    saver = DiskSaver(args.output_dir, require_empty=False)
    trainer.add_event_handler(Events.COMPLETED, Checkpoint({"model": model}, saver, filename_prefix="final"))
    trainer.run(train_loader, max_epochs=args.epochs)

    if rank == 0:
        (path,) = Path(args.output_dir).glob("final_model_*.pt")
        plain = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
        load_checkpoint(path, {"model": plain}, map_location="cpu")
        print(f"saved {path.name}; it loads into the unwrapped model", flush=True)


if __name__ == "__main__":  # spawned workers import this file: keep the launch under the main guard
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/custom_training")
    launch(run, parser.parse_args(), nproc=parser.parse_args().nproc)
