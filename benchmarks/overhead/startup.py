"""Start-up figures of bench_overhead.py: launch to the first finished iteration, hand-written against ``ignite-mgpu
train`` (bench_startup.py's measure), and the time of ``ignite-mgpu --help``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from benchmarks.overhead.bench_startup import ROOT, console_script, measure


def time_to_first_iteration(tmp: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds from starting the command to rank 0's first finished optimizer step, hand-written ``mp.spawn``
    against ``ignite-mgpu train`` on the small CNN, 2 processes, and the CPU seconds of each whole command: the
    measure of bench_startup.py (from outside, with its tracer), so that the two benchmarks agree."""
    names = {"hand-written mp.spawn": "hand-written", "ignite-mgpu train": "ignite-mgpu"}
    seen = measure(tmp, "cnn", 2, [ROOT], rounds, only=tuple(names))
    return {
        key: {names[name]: [run[figure] for run in runs] for name, runs in seen.items()}
        for key, figure in (("wall", "first step"), ("cpu", "cpu"))
    }


def help_seconds(rounds: int) -> list[float]:
    found = []
    for _ in range(max(3, rounds)):
        start = time.perf_counter()
        subprocess.run([console_script(), "--help"], capture_output=True, check=True)
        found.append(time.perf_counter() - start)
    return found
