"""The starting point of docs/tutorials/from-dataparallel.md: a classic nn.DataParallel script for GPUs 2 and 3 of a
shared server, whose model computes its loss in forward(). Without CUDA it runs on the CPU (DataParallel then calls
the model directly).

    python before.py --epochs 3
"""

import argparse
from pathlib import Path

import torch
from project import Net, make_split
from torch import nn
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--out", default="runs/before/model.pt")
args = parser.parse_args()

gpus = [2, 3] if torch.cuda.is_available() else None  # device_ids: CUDA's numbering, which may not be nvidia-smi's
device = f"cuda:{gpus[0]}" if gpus else "cpu"  # the model lives on the first; it scatters and gathers
torch.manual_seed(0)
model = nn.DataParallel(Net().to(device), device_ids=gpus)
train_loader = DataLoader(make_split(2048, seed=1), batch_size=args.batch_size, shuffle=True)
val_loader = DataLoader(make_split(500, seed=2), batch_size=500)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

for epoch in range(1, args.epochs + 1):
    model.train()
    for x, y in train_loader:
        optimizer.zero_grad()
        loss = model(x.to(device), y.to(device)).mean()  # one loss per GPU, gathered into a vector: averaged
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in val_loader:
            correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    print(f"epoch {epoch}: loss {loss.item():.4f} val_accuracy {correct / 500:.4f}")

Path(args.out).parent.mkdir(parents=True, exist_ok=True)
torch.save(model.module.state_dict(), args.out)  # .module: the wrapper's own state_dict has "module." keys
