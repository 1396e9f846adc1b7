"""An ignite script that starts its own process group with ``idist.Parallel``, as ignite's examples do under
torchrun; it knows nothing of ignite-mgpu. Tiny regression data, so it runs on the CPU (gloo) too.

    torchrun --nproc_per_node 2 idist_parallel.py --epochs 2 --out result.json
    ignite-mgpu run --nproc 2 idist_parallel.py --epochs 2 --out result.json
"""

import argparse
import json

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_trainer
from torch import nn
from torch.utils.data import TensorDataset


def training(local_rank, args):
    generator = torch.Generator().manual_seed(0)  # the same data on every rank; the sampler splits it
    x = torch.rand(512, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    loader = idist.auto_dataloader(TensorDataset(x, y), batch_size=64, shuffle=True)  # global batch, split
    torch.manual_seed(0)
    model = idist.auto_model(nn.Linear(8, 1))  # DDP over the group Parallel joined
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss(), device=idist.device())
    losses = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda engine: losses.append(engine.state.output))
    trainer.run(loader, max_epochs=args.epochs)
    ranks = idist.all_reduce(torch.tensor([float(idist.get_rank())]))  # 0 + 1 + ... on every rank
    if idist.get_rank() == 0:
        result = {"world_size": idist.get_world_size(), "backend": idist.backend(), "sum_of_ranks": ranks.item()}
        print(json.dumps(result | {"losses": losses}))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result | {"losses": losses}, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="ignite training with idist.Parallel")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default="", help="where rank 0 writes the result as JSON")
    args = parser.parse_args()
    # Parallel reads RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun (or ignite-mgpu run) set them.
    with idist.Parallel(backend="nccl" if torch.cuda.is_available() else "gloo") as parallel:
        parallel.run(training, args)
