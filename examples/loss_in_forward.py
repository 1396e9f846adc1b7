"""A model that computes its own loss in forward(), as many notebooks do. Under nn.DataParallel each GPU returns
its own 0-dim loss and DataParallel stacks them into a vector (with the warning "Was asked to gather along
dimension 0, but all input tensors were scalars"); ignite-mgpu reduces that vector to the exact batch loss,
weighting each GPU by its share of the batch. Under DDP each process's loss is averaged over processes for logs.

    python examples/loss_in_forward.py --strategy dp            # one process, every GPU (DataParallel)
    python examples/loss_in_forward.py --strategy ddp --nproc 2  # a process per GPU, or per CPU worker here
"""

from __future__ import annotations

import argparse

import ignite.distributed as idist
import torch
from ignite.engine import Events
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ignite_mgpu import create_trainer, launch, prepare_model


class RegressorWithLoss(nn.Module):
    """forward(x, y) returns the mean squared error; forward(x) returns predictions."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        pred = self.net(x).squeeze(1)
        return pred if y is None else nn.functional.mse_loss(pred, y)


def run(local_rank: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    x = torch.randn(args.samples, 8)
    y = x @ torch.linspace(-1, 1, 8) + 0.05 * torch.randn(args.samples)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, idist.get_world_size(), idist.get_rank(), shuffle=True, seed=0)
    loader = idist.auto_dataloader(ds, batch_size=args.batch_size, sampler=sampler)
    model = prepare_model(RegressorWithLoss(), strategy=args.strategy)
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    trainer = create_trainer(model, optimizer, loss_fn=None, check_every=4)  # None: forward returns the loss

    @trainer.on(Events.EPOCH_COMPLETED)
    def log(engine):
        if idist.get_rank() == 0:
            print(
                f"epoch {engine.state.epoch}: loss {engine.state.metrics['train_loss']:.5f} "
                f"({type(model).__name__}, {idist.get_world_size()} process(es))",
                flush=True,
            )

    trainer.run(loader, max_epochs=args.epochs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["ddp", "dp"], default="ddp")
    parser.add_argument("--nproc", type=int, default=None, help="processes (ddp); dp always uses one")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (the last one may be uneven)")
    args = parser.parse_args()
    launch(run, args, nproc=args.nproc, strategy=args.strategy)
