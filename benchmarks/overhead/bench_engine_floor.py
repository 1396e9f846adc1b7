"""Where the per-iteration CPU time goes, on one process without communication: a plain loop, ignite's bare
``Engine`` running the same step, ignite-mgpu's ``create_trainer`` (step, guard, sampler epochs) and the same with
the ``EpochLog`` that ``ignite-mgpu train`` attaches, over the timed loader it trains from (the data-wait timer
runs every iteration).

All four train the same tiny MLP on the same in-memory batches with one thread pinned to one core, timed with the
thread's CPU clock (``time.thread_time``), so neither other processes nor waiting count. Rounds alternate the four
loops; the figure is each loop's fastest round, and "extra" is its difference to the plain loop.

Run: python benchmarks/overhead/bench_engine_floor.py [--rounds 7] [--iters 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool
# This checkout's ignite_mgpu is the one measured: the repository root goes first on sys.path, as in every benchmark.
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from ignite.engine import Engine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ignite_mgpu.train.data.loaders import timed
from ignite_mgpu.train.epoch_log import EpochLog
from ignite_mgpu.train.step.trainer import create_trainer

BATCH, FEATURES, CLASSES = 16, 192, 10  # the benchmark's tiny MLP input: 3 x 8 x 8 images, 16 per process


def setup(iters: int) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader, nn.Module]:
    torch.manual_seed(0)
    x, y = torch.randn(iters * BATCH, FEATURES), torch.randint(0, CLASSES, (iters * BATCH,))
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, optimizer, DataLoader(TensorDataset(x, y), batch_size=BATCH), nn.CrossEntropyLoss()


def plain(iters: int) -> float:
    model, optimizer, loader, loss_fn = setup(iters)
    start = time.thread_time()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
    return (time.thread_time() - start) / iters


def bare_engine(iters: int) -> float:
    model, optimizer, loader, loss_fn = setup(iters)

    def step(engine: Engine, batch: list[torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return loss.detach()

    engine = Engine(step)
    start = time.thread_time()
    engine.run(loader)
    return (time.thread_time() - start) / iters


def ignite_mgpu_trainer(iters: int, report: bool) -> float:
    model, optimizer, loader, loss_fn = setup(iters)
    trainer = create_trainer(model, optimizer, loss_fn, device="cpu")
    if report:
        loader = timed(loader)  # as create_dataloaders gives it to the default job
        with tempfile.TemporaryDirectory() as tmp:
            EpochLog(Path(tmp, "metrics.jsonl"), BATCH, Engine(lambda e, b: None), [torch.device("cpu")]).attach(
                trainer
            )
            start = time.thread_time()
            trainer.run(loader)
            return (time.thread_time() - start) / iters
    start = time.thread_time()
    trainer.run(loader)
    return (time.thread_time() - start) / iters


LOOPS: dict[str, Callable[[int], float]] = {
    "plain loop": plain,
    "ignite Engine, same step": bare_engine,
    "ignite-mgpu create_trainer": lambda n: ignite_mgpu_trainer(n, report=False),
    "ignite-mgpu create_trainer + EpochLog": lambda n: ignite_mgpu_trainer(n, report=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of all four loops [7]")
    parser.add_argument("--iters", type=int, default=2000, help="iterations per loop and round [2000]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    seconds: dict[str, list[float]] = {name: [] for name in LOOPS}
    for r in range(args.rounds):
        for name in LOOPS if r % 2 == 0 else reversed(LOOPS):
            seconds[name].append(LOOPS[name](args.iters))
    base = min(seconds["plain loop"])
    print(f"{args.rounds} rounds of {args.iters} iterations, 1 process, 1 thread on 1 core\n")
    print("| loop | CPU µs / iteration, fastest round | median | extra over the plain loop |")
    print("|---|---|---|---|")
    for name, values in seconds.items():
        best = min(values)
        print(f"| {name} | {1e6 * best:.1f} | {1e6 * statistics.median(values):.1f} | {1e6 * (best - base):+.1f} |")


if __name__ == "__main__":
    main()
