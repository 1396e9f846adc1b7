"""How true the step's split is (issue #51, ``ignite_mgpu/train/step/timing.py``): on 2 gloo processes, DDP steps with
the gradient sync alternate with the same steps under ``no_sync``; the split of the synced steps (compute, the
all-reduce wait noted by the timed comm hook) is held against the unsynced step (the compute alone) and against the
time the sync added (the wait). A 2-layer MLP at several widths and batches, 1 thread per process.
Run: `python benchmarks/step_split/bench_step_split.py` (about a minute on 2 cores); `--quick`: one small size, few
steps (the script's check, figures meaningless).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from ignite_mgpu.train.step.timing import StepTimes, watch_gradient_sync  # noqa: E402

SIZES = [(4096, 16), (4096, 256), (4096, 1024), (32768, 16)]  # (hidden width, samples per process)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, width: int, batch: int, steps: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
    model = DistributedDataParallel(net)
    times = StepTimes(torch.device("cpu"))
    watch_gradient_sync(None, model, times, 2)
    x = torch.randn(batch, 64)
    total = {True: 0.0, False: 0.0}

    def step(sync: bool, counted: bool = True) -> None:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with contextlib.nullcontext() if sync else model.no_sync():
            model(x).sum().backward()
        end = time.perf_counter()
        if counted:
            total[sync] += end - start
            if sync:
                times.add(start, end)

    for _ in range(max(2, steps // 10)):
        step(True, counted=False)
    for _ in range(steps):  # alternating: both kinds of step see the same machine
        step(True)
        step(False)
    compute, comm, _ = times.seconds()
    if rank == 0:
        params = sum(p.numel() for p in net.parameters())
        row = [params, batch, total[True], total[False], compute, comm]
        Path(out).write_text(" ".join(f"{1000 * v / steps:.3f}" if i > 1 else str(v) for i, v in enumerate(row)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small size, few steps: the script's check")
    args = parser.parse_args()
    sizes, steps = ([(256, 16)], 10) if args.quick else (SIZES, 100)
    print("| parameters | samples / process | synced step, ms | its compute, ms | unsynced step, ms | compute / "
          "unsynced | its all-reduce wait, ms | sync's cost, ms | wait / cost |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    out = Path(f"/tmp/bench_step_split_{os.getpid()}.txt")
    for width, batch in sizes:
        mp.spawn(worker, (width, batch, steps, free_port(), str(out)), nprocs=2)
        params, samples, synced, unsynced, compute, comm = out.read_text().split()
        cost = float(synced) - float(unsynced)
        ratio = f"{float(comm) / cost:.2f}" if cost > 0 else "-"
        print(f"| {int(params):,} | {samples} | {synced} | {compute} | {unsynced} | "
              f"{float(compute) / float(unsynced):.2f} | {comm} | {cost:.3f} | {ratio} |")  # fmt: skip
    out.unlink(missing_ok=True)
    if args.quick:
        print("(--quick: one small size, few steps; the figures are not meaningful, only the run is)")


if __name__ == "__main__":
    main()
