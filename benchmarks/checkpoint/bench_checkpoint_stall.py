"""The training step's stall per checkpoint save, synchronous vs ``checkpoint.async_save``, interleaved.

A ~170M-parameter model (a stack of 4096x4096 linear layers, AdamW with its state created: 2 GB of checkpoint
state in fp32) trains on the CPU; every ``--iters`` iterations the full training state is saved through the
project's savers: ``checkpoint.format=full`` (one file, ``SafeDiskSaver`` vs ``AsyncDiskSaver``) in this process,
and ``checkpoint.format=sharded`` (``ShardedCheckpoint``, synchronous vs ``torch.distributed.checkpoint.async_save``)
on 2 gloo processes under FSDP2. The saves alternate sync, async, sync, async ...; each save's stall is the training
thread's time in the handler (async: waiting for the previous write, and the snapshot). The iterations after each
save are timed too: an async write runs during them.

    python benchmarks/checkpoint/bench_checkpoint_stall.py            # ~170M parameters, 3 repetitions
    python benchmarks/checkpoint/bench_checkpoint_stall.py --quick    # a small model, seconds (the smoke test)

The folders are made under ``--dir`` (default: a temporary folder) and deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Counter:
    """What the trainer and the run info add to a checkpoint: a small state_dict."""

    def __init__(self) -> None:
        self.iteration = 0

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.iteration = state["iteration"]


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def step(model: nn.Module, optimizer: torch.optim.Optimizer, width: int) -> None:
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def engine_at(iteration: int) -> Any:
    from ignite.engine import Engine

    engine = Engine(lambda e, b: None)
    engine.state.iteration = iteration
    return engine


def timed_iterations(model: nn.Module, optimizer: torch.optim.Optimizer, width: int, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step(model, optimizer, width)
        times.append(time.perf_counter() - start)
    return times


def full_format(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    """Sync and async saves of one file, interleaved; returns stalls and iteration times by mode."""
    from ignite.handlers import Checkpoint

    from ignite_mgpu.checkpoint.background import AsyncDiskSaver
    from ignite_mgpu.checkpoint.save import SafeDiskSaver

    model = make_model(args.width, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, optimizer, args.width)  # the optimizer's state exists
    to_save = {"model": model, "optimizer": optimizer, "trainer": Counter()}
    handlers: dict[str, Any] = {}
    for mode, saver in (("sync", SafeDiskSaver(root / "sync")), ("async", AsyncDiskSaver(root / "async"))):
        handlers[mode] = Checkpoint(to_save, saver, n_saved=1, global_step_transform=lambda e, _: e.state.iteration)
    found: dict[str, list[float]] = {f"{k}_{m}": [] for k in ("stall", "iter", "spill") for m in handlers}
    timed_iterations(model, optimizer, args.width, 2)  # warm
    iteration = 0
    for rep in range(args.reps + 1):  # the first round warms the stager's buffers and the page cache: not counted
        for mode, handler in handlers.items():
            iteration += args.iters
            to_save["trainer"].iteration = iteration
            start = time.perf_counter()
            handler(engine_at(iteration))
            stall = time.perf_counter() - start
            times = timed_iterations(model, optimizer, args.width, args.iters)
            start = time.perf_counter()
            if mode == "async":  # the write must not spill into the next sync save's measurement
                handler.save_handler.writer.wait()
            if rep:
                found[f"stall_{mode}"].append(stall)
                found[f"iter_{mode}"].append(statistics.median(times))
                found[f"spill_{mode}"].append(time.perf_counter() - start)
    handlers["async"].save_handler.finish()
    return found


def _sharded_worker(rank: int, args: argparse.Namespace, root: Path, results: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint
    from ignite_mgpu.checkpoint.state import checkpoint_objects

    dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = make_model(args.width, args.layers)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, optimizer, args.width)
    model_state, optimizer_state = checkpoint_objects(model, optimizer)
    to_save = {"model": model_state, "optimizer": optimizer_state, "trainer": Counter()}
    handlers = {mode: ShardedCheckpoint(to_save, root / mode, 1, mode == "async") for mode in ("sync", "async")}
    found: dict[str, list[float]] = {f"{k}_{m}": [] for k in ("stall", "iter", "spill") for m in handlers}
    iteration = 0
    for rep in range(args.reps + 1):
        for mode, handler in handlers.items():
            iteration += args.iters
            to_save["trainer"].iteration = iteration
            dist.barrier()
            start = time.perf_counter()
            handler(engine_at(iteration))
            stall = torch.tensor(time.perf_counter() - start)
            times = timed_iterations(model, optimizer, args.width, args.iters)
            start = time.perf_counter()
            if handler.writer is not None:
                handler.writer.wait()
            spill = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(stall, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
            dist.all_reduce(spill, op=dist.ReduceOp.MAX)
            if rep:
                found[f"stall_{mode}"].append(float(stall))
                found[f"iter_{mode}"].append(statistics.median(times))
                found[f"spill_{mode}"].append(float(spill))
    handlers["async"].finish()
    if rank == 0:
        torch.save(found, results)
    dist.barrier()  # neither rank exits while a gloo thread may still release its last all-reduce (SIGABRT)
    dist.destroy_process_group()


def sharded_format(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    import torch.multiprocessing as mp

    results = root / "sharded_results.pt"
    mp.spawn(_sharded_worker, args=(args, root, results), nprocs=2)
    found: dict[str, list[float]] = torch.load(results)
    return found


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})"


def report(name: str, found: dict[str, list[float]]) -> list[str]:
    ratios = [a / s for a, s in zip(found["stall_async"], found["stall_sync"], strict=True)]
    iters = [a / s for a, s in zip(found["iter_async"], found["iter_sync"], strict=True)]
    return [
        f"{name}: stall per save, sync  {spread(found['stall_sync'])}",
        f"{name}: stall per save, async {spread(found['stall_async'])}",
        f"{name}: async / sync stall ratio {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
        f"max {max(ratios):.3f}), n={len(ratios)}",
        f"{name}: median iteration after a save, sync {spread(found['iter_sync'])}, async (write in the "
        f"background) {spread(found['iter_async'])}; ratio {statistics.median(iters):.3f} "
        f"(min {min(iters):.3f}, max {max(iters):.3f})",
        f"{name}: async write still running after the iterations between saves: {spread(found['spill_async'])}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 2 repetitions (seconds)")
    parser.add_argument("--reps", type=int, default=3, help="sync/async pairs of saves per format")
    parser.add_argument("--iters", type=int, default=6, help="training iterations between saves")
    parser.add_argument("--formats", default="full,sharded", help="full, sharded, or both")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temp folder)")
    args = parser.parse_args()
    args.width, args.layers = (256, 4) if args.quick else (4096, 10)
    if args.quick:
        args.reps, args.iters = 2, 2
    params = args.layers * (args.width * args.width + args.width)
    print(f"model: {params / 1e6:.1f}M parameters, AdamW; checkpoint state {params * 12 / 1e9:.2f} GB (fp32)")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.reps} interleaved sync/async pairs")
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    lines = []
    try:
        for name in args.formats.split(","):
            folder = root / name
            folder.mkdir()
            found = full_format(args, folder) if name == "full" else sharded_format(args, folder)
            lines += report(name, found)
            shutil.rmtree(folder)
            print("\n".join(lines[-5:]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
