"""before.py moved to ignite-mgpu, the Python path (docs/tutorials/from-dataparallel.md): one process per GPU (DDP),
or 2 gloo processes on a machine without GPUs.

    python after.py --nproc 2 --epochs 3
"""

import argparse
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.engine import Events
from project import Net, make_split

from ignite_mgpu import create_dataloader, create_evaluator, create_trainer, launch, prepare_model, validation_metrics


def run(local_rank: int, args: argparse.Namespace) -> None:
    """Runs in every process; idist knows this process's rank and device."""
    torch.manual_seed(0)  # every rank builds the same initial weights (DDP also broadcasts rank 0's)
    train_loader = create_dataloader(make_split(2048, seed=1), args.batch_size, train=True)  # the global batch
    val_loader = create_dataloader(make_split(500, seed=2), 500, train=False)  # every sample scored exactly once
    net = Net()
    # DDP around net on this process's device; on GPUs, BatchNorm statistics over the whole batch (SyncBatchNorm
    # needs CUDA). net itself stays the plain model: its state_dict has no "module." prefix.
    model = prepare_model(net, sync_batchnorm=idist.device().type == "cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # loss_fn=None: the model computes its loss, model(x, y); each process's from its share of the batch.
    trainer = create_trainer(model, optimizer, loss_fn=None)  # moves batches to the device, sets the sampler's epoch
    evaluator = create_evaluator(model, validation_metrics(None, idist.device()), model_loss=True)

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        metrics = evaluator.run(val_loader).metrics  # reduced over every process, weighted by each one's samples
        if idist.get_rank() == 0:  # print once, not once per process
            loss = engine.state.metrics["train_loss"]
            print(f"epoch {engine.state.epoch}: loss {loss:.4f} val_loss {metrics['loss']:.4f}", flush=True)

    trainer.run(train_loader, max_epochs=args.epochs)
    if idist.get_rank() == 0:  # one writer
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(net.state_dict(), args.out)


if __name__ == "__main__":  # spawned processes import this file: the launch must not run again in them
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=None)  # default: one process per GPU, or 1 on a CPU
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)  # global, as DataParallel's was
    parser.add_argument("--out", default="runs/after/model.pt")
    args = parser.parse_args()
    launch(run, args, nproc=args.nproc)
