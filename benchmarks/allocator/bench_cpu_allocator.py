"""What ``keep_freed_memory`` (glibc mallopt, on by default for CPU training) changes: time per training step, page
faults per step and peak RSS of the default small CNN on one thread, with glibc's default malloc and with it.

mallopt cannot be undone in a process, so every measurement runs in a fresh interpreter, pinned to one core; rounds
alternate the order (default, keep; keep, default; ...). The ratio column is default / keep of each round.

Run: python benchmarks/allocator/bench_cpu_allocator.py [--rounds 5] [--steps 20] [--batch 128 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# This checkout's ignite_mgpu is the one measured: the repository root goes first on sys.path, as in every benchmark.
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODES = ("glibc default", "keep_freed_memory")


def child(mode: str, batch: int, steps: int) -> None:
    """One measurement: warm up, then time ``steps`` SGD steps; print ms/step, faults/step and peak RSS as JSON."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import resource
    import time

    import torch
    from torch import nn

    from ignite_mgpu.config.schema import ModelConfig
    from ignite_mgpu.train.allocator import keep_freed_memory
    from ignite_mgpu.train.models import create_model

    torch.set_num_threads(1)
    if mode == MODES[1] and (why_not := keep_freed_memory()) is not None:
        sys.exit(f"keep_freed_memory did nothing: {why_not}")
    torch.manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    model = create_model(ModelConfig(), x[:1])  # the default job's small CNN
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(steps):
        step()
    seconds, usage = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"ms": 1000 * seconds / steps, "faults": (usage.ru_minflt - faults) / steps,
                      "rss_mb": usage.ru_maxrss / 1024}))  # fmt: skip


def measure(mode: str, batch: int, steps: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", mode, "--batch", str(batch), "--steps", str(steps)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own defaults
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measurements per mode and batch size [5]")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement, after 3 warm-up [20]")
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 1024], help="batch sizes [128 1024]")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch[0], args.steps)
        return
    print(f"small CNN, 1 thread on 1 core, {args.rounds} rounds of {args.steps} steps (median (min–max))\n")
    print("| batch | malloc | ms / step | page faults / step | peak RSS, MB | glibc default / keep, per round |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        found: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                found[mode].append(measure(mode, batch, args.steps))
        ratios = [a["ms"] / b["ms"] for a, b in zip(found[MODES[0]], found[MODES[1]], strict=True)]
        for mode, runs in found.items():
            ratio = spread(ratios, 2) + "×" if mode == MODES[1] else ""
            print(
                f"| {batch} | {mode} | {spread([r['ms'] for r in runs])} | {spread([r['faults'] for r in runs], 0)} "
                f"| {spread([r['rss_mb'] for r in runs], 0)} | {ratio} |"
            )


if __name__ == "__main__":
    main()
