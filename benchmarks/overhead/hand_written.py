"""The hand-written DDP script that ``bench_startup.py`` starts against ``ignite-mgpu``: what a user writes without
it, importing torch only. The same model, data, optimizer and batch as ``ignite-mgpu train`` with the workload's
overrides: synthetic images, one epoch, an evaluation of the validation split, the model's weights saved by rank 0.

Run it either way:
  python hand_written.py WORKLOAD OUT --spawn N     # torch.multiprocessing.spawn, N gloo processes
  torchrun --nproc-per-node N hand_written.py WORKLOAD OUT   (or `ignite-mgpu run --nproc N hand_written.py ...`)
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# workload -> image side, global batch, iterations in the epoch, validation samples; bench_startup.py's overrides
WORKLOADS = {"mlp": (8, 32, 300, 64), "cnn": (32, 128, 24, 64)}


class SimpleCNN(nn.Module):
    """ignite-mgpu's default model (ignite_mgpu/train/models.py), written out."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True),
        )  # fmt: skip
        self.classifier = nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.classifier(torch.flatten(nn.functional.avg_pool2d(x, x.shape[-1] // 4), 1))


def model_of(workload: str, side: int) -> nn.Module:
    if workload == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * side * side, 128), nn.ReLU(inplace=True), nn.Linear(128, 10))
    return SimpleCNN()


def train(rank: int, world_size: int, workload: str, out: str) -> None:
    side, batch, iters, val = WORKLOADS[workload]
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    train_set = TensorDataset(
        torch.randn(batch * iters, 3, side, side, generator=g), torch.randint(10, (batch * iters,))
    )
    val_set = TensorDataset(torch.randn(val, 3, side, side, generator=g), torch.randint(10, (val,)))
    model = DistributedDataParallel(model_of(workload, side))
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=batch // world_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    loss_fn = nn.CrossEntropyLoss()
    sampler.set_epoch(0)
    model.train()
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    model.eval()
    correct = torch.zeros(2)
    with torch.no_grad():
        for x, y in DataLoader(
            val_set, batch_size=batch // world_size, sampler=DistributedSampler(val_set, world_size, rank)
        ):
            correct += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    dist.all_reduce(correct)
    if rank == 0:
        print(f"val_acc {correct[0] / correct[1]:.4f}")
        torch.save(model.module.state_dict(), Path(out, "model.pt"))
    dist.barrier()  # neither rank tears gloo down while the other may still send ("terminate called ...": SIGABRT)
    dist.destroy_process_group()


def spawned(rank: int, world_size: int, workload: str, out: str) -> None:
    torch.set_num_threads(1)
    train(rank, world_size, workload, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("out")
    parser.add_argument("--spawn", type=int, metavar="N", help="start N processes with torch.multiprocessing.spawn")
    args = parser.parse_args()
    if args.spawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        mp.spawn(spawned, args=(args.spawn, args.workload, args.out), nprocs=args.spawn)
    else:  # torchrun, ignite-mgpu run: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set
        torch.set_num_threads(1)
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.workload, args.out)


if __name__ == "__main__":
    main()
