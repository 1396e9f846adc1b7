"""Launch to the first finished iteration: the hand-written ``torch.multiprocessing.spawn`` script against
``ignite-mgpu train``, on 2 and on 4 gloo processes, with other checkouts of ignite-mgpu in the same rounds.

The commands and the marker files are bench_overhead.py's (``startup.py``): the hand-written script's rank 0 writes
a file after its first DDP step; ignite-mgpu's marker is metrics.jsonl, written after its one-iteration epoch, a
validation of one sample per rank and the best model's save. Each round runs every command once, in an order that
alternates.
Run: `python benchmarks/overhead/bench_startup.py [--rounds 5] [--nproc 2 4] [--package-root /work/main]`
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # as bench_overhead.py: one thread per process, in every command
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

JOB = ["train", "--backend", "gloo", "train.epochs=1", "train.epoch_length=1", "checkpoint.every=0"]


def commands(out: Path, nproc: int, roots: list[Path]) -> dict[str, tuple[list[str], Path, dict[str, str]]]:
    """name -> (command, marker file, environment) for one round's runs into ``out``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "SLURM_"))}
    hand = [sys.executable, __file__, "--reference", str(out / "hand"), str(nproc)]
    runs = {"hand-written": (hand, out / "hand" / "first_iteration", env | {"PYTHONPATH": str(ROOT)})}
    for root in roots:
        folder = out / f"ignite-mgpu-{len(runs)}"
        cmd = [sys.executable, "-m", "ignite_mgpu", *JOB, f"data.val_size={nproc}", "--nproc", str(nproc)]
        cmd += ["--output-dir", str(folder)]
        runs[f"ignite-mgpu {root}"] = (cmd, folder / "metrics.jsonl", env | {"PYTHONPATH": str(root)})
    return runs


def measure(tmp: Path, nproc: int, roots: list[Path], rounds: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {}
    for r in range(rounds):
        out = tmp / f"{nproc}-{r}"
        (out / "hand").mkdir(parents=True)
        runs = list(commands(out, nproc, roots).items())
        for name, (cmd, marker, env) in runs if r % 2 == 0 else runs[::-1]:
            start = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
            if proc.returncode or not marker.exists():
                sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            seconds.setdefault(name, []).append(marker.stat().st_mtime - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--package-root", type=Path, nargs="*", default=[], help="other checkouts to measure too")
    parser.add_argument("--reference", nargs=2, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.reference:
        import torch.multiprocessing as mp

        from benchmarks.overhead.startup import reference_worker

        out, nproc = opts.reference[0], int(opts.reference[1])
        mp.spawn(reference_worker, args=(out, nproc), nprocs=nproc)
        return
    roots = [ROOT, *opts.package_root]
    print(f"{os.cpu_count()} CPUs; load average before {os.getloadavg()[0]:.2f}; {opts.rounds} round(s)")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as name:
        for nproc in opts.nproc:
            seconds = measure(Path(name), nproc, roots, opts.rounds)
            hand = statistics.median(seconds["hand-written"])
            for label, values in seconds.items():
                median = statistics.median(values)
                print(
                    f"{nproc} processes, {label:40s}: median {median:.2f} s (min {min(values):.2f}, max "
                    f"{max(values):.2f}); {median / hand:.2f}x the hand-written",
                    flush=True,
                )
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
