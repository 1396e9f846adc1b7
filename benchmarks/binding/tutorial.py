"""The default job written as the PyTorch DDP tutorial writes it (pytorch/examples distributed/ddp-tutorial-series,
multigpu.py): ``torch.multiprocessing.spawn``, DDP, ``DistributedSampler``, no binding, threads as torch picks them,
glibc's malloc as it is. Same model, data, seed, global batch, optimizer and schedule as ``ignite-mgpu train``.

Run by bench_binding.py: python benchmarks/binding/tutorial.py OUT.json [--nproc 2] [--epochs 2] [--train-size 4096]
Rank 0 writes the training samples/s (epoch loops only, as ignite-mgpu's report counts) and the final accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import barrier, destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ignite_mgpu.train.data.datasets import SyntheticImages
from ignite_mgpu.train.models import SimpleCNN


def ddp_setup(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"  # MASTER_PORT: a free port the parent chose (a fixed one may collide)
    init_process_group(backend="gloo", rank=rank, world_size=world_size)


class Trainer:
    def __init__(self, model, train_data, optimizer, scheduler, gpu_id):
        self.gpu_id = gpu_id
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.seconds = 0.0

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        start = time.perf_counter()
        for source, targets in self.train_data:
            self._run_batch(source, targets)
        self.seconds += time.perf_counter() - start

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def load_train_objs(args):
    train_set = SyntheticImages(args.train_size, 10, 32, seed=0, train=True)  # the default job's data
    torch.manual_seed(0)  # the default job seeds, builds its data, then its model
    model = SimpleCNN(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    return train_set, model, optimizer


def warmup_cosine(total, warmup):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      sampler=DistributedSampler(dataset))  # fmt: skip


def main(rank, world_size, args):
    ddp_setup(rank, world_size)
    dataset, model, optimizer = load_train_objs(args)
    train_data = prepare_dataloader(dataset, args.batch_size // world_size)
    steps = len(train_data)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps * args.epochs, round(steps * 0.2)))
    trainer = Trainer(model, train_data, optimizer, scheduler, rank)
    trainer.train(args.epochs)
    if rank == 0:  # the final accuracy, on the default job's validation split (not timed)
        val = SyntheticImages(1000, 10, 32, seed=0, train=False)
        model.eval()
        with torch.no_grad():
            accuracy = (model(val.images).argmax(1) == val.targets).float().mean().item()
        samples = steps * args.batch_size * args.epochs
        result = {"samples_per_s": samples / trainer.seconds, "val_accuracy": accuracy,
                  "threads": torch.get_num_threads(), "weights": args.out + ".pt"}  # fmt: skip
        torch.save(model.state_dict(), args.out + ".pt")
        with open(args.out, "w") as f:
            json.dump(result, f)
    # Not in the tutorial: a rank that exits while a gloo thread still releases its last all-reduce's tensors can
    # abort at interpreter shutdown ("terminate called without an active exception", SIGABRT; seen once in CI).
    # Waiting for every rank lets those threads finish first, as ignite-mgpu's workers do. Not timed.
    barrier()
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the default job as the DDP tutorial writes it")
    parser.add_argument("out")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128)  # global, as data.batch_size
    args = parser.parse_args()
    mp.spawn(main, args=(args.nproc, args), nprocs=args.nproc)
