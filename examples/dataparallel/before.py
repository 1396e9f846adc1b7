"""The starting point of docs/tutorials/from-dataparallel.md: a typical nn.DataParallel training script.
On a machine without GPUs it runs on the CPU (DataParallel then calls the model directly).

    python examples/dataparallel/before.py --epochs 3
"""

import argparse

import torch
from project import Net, make_split
from torch import nn
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--out", default="model.pt")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.DataParallel(Net().to(device))  # every visible GPU; GPU 0 scatters the batch and gathers the outputs
train_loader = DataLoader(make_split(2048, seed=1), batch_size=args.batch_size, shuffle=True)
val_loader = DataLoader(make_split(500, seed=2), batch_size=500)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()

for epoch in range(1, args.epochs + 1):
    model.train()
    for x, y in train_loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in val_loader:
            correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    print(f"epoch {epoch}: loss {loss.item():.4f} val_accuracy {correct / 500:.4f}")

torch.save(model.module.state_dict(), args.out)  # .module: the wrapper's own state_dict has "module." keys
