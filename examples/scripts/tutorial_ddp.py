"""A plain PyTorch DDP training script, written as the PyTorch DDP tutorial writes it (multigpu_torchrun.py): it
reads what torchrun gives every process and knows nothing of ignite-mgpu. Tiny model and data, so it runs on the
CPU (gloo) too.

    torchrun --nproc_per_node 2 tutorial_ddp.py --epochs 1 --out model.pt
    ignite-mgpu run --nproc 2 tutorial_ddp.py --epochs 1 --out model.pt      # the same weights, bit for bit
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


class MyTrainDataset(Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)  # the same data in every process
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if snapshot_path and os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)  # a restarted job continues where the snapshot left it
        self.model = DDP(self.model, device_ids=[self.local_rank] if torch.cuda.is_available() else None)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        for source, targets in self.train_data:
            loss = self._run_batch(source.to(self.device), targets.to(self.device))
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Steps: {len(self.train_data)} | loss {loss:.5f}")

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.snapshot_path and self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)


def main(args):
    ddp_setup()
    torch.manual_seed(0)  # DDP broadcasts rank 0's initial weights; the seed makes them the same in every run
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    dataset = MyTrainDataset(args.samples)
    train_data = DataLoader(
        dataset, batch_size=args.batch_size, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset)
    )
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot)
    trainer.train(args.epochs)
    if args.out and int(os.environ["RANK"]) == 0:
        torch.save(trainer.model.module.state_dict(), args.out)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--epochs", type=int, required=True, help="total epochs to train the model")
    parser.add_argument("--save-every", type=int, default=1, help="how often to save a snapshot (epochs)")
    parser.add_argument("--batch-size", type=int, default=8, help="input batch size on each device")
    parser.add_argument("--samples", type=int, default=256, help="size of the synthetic dataset")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--snapshot", default="", help="snapshot file to resume from and save to")
    parser.add_argument("--out", default="", help="where rank 0 saves the trained model's state_dict")
    main(parser.parse_args())
