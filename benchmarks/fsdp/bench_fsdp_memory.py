"""Peak memory per rank, DDP against FSDP, for one job whose parameters, gradients and AdamW state dwarf what every
process starts with: a wide MLP (169M parameters), AdamW, 3 steps on tiny synthetic data, 1 and 2 processes. It
runs `ignite-mgpu train` for each and prints the table of `peak_memory_mb` from each run's metrics.jsonl.

    python benchmarks/fsdp/bench_fsdp_memory.py                # about 2 minutes on 2 CPU cores; needs ~10 GB of memory
    python benchmarks/fsdp/bench_fsdp_memory.py --quick        # a 0.2M-parameter MLP, 2 jobs at once: checks the script
    python benchmarks/fsdp/bench_fsdp_memory.py --gpus 0,1     # the same on GPUs: peak allocated CUDA memory per GPU

On the CPU the figure is each process's peak RSS, on GPUs CUDA's peak allocated memory of each GPU. The target
(issue #16): 2-process FSDP's per-rank peak at most 0.7 of DDP's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch import nn

REPO = Path(__file__).resolve().parents[2]  # the jobs run here: model.name imports benchmarks.fsdp
TARGET = 0.7


def wide_mlp(num_classes: int = 10, width: int = 4096, depth: int = 11, inputs: int = 3 * 8 * 8) -> nn.Module:
    """``depth`` Linear layers of ``width`` (one Sequential: FSDP's default rule shards each Linear)."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


def run(strategy: str, nproc: int, width: int, depth: int, gpus: str | None, work: Path) -> dict:
    out = work / f"{strategy}-{nproc}"
    args = [
        "model.name=benchmarks.fsdp.bench_fsdp_memory:wide_mlp",
        f"model.args={{width: {width}, depth: {depth}}}",
        "data.image_size=8",
        "data.train_size=64",
        "data.val_size=8",
        "data.batch_size=8",
        "optim.name=adamw",
        "train.epochs=1",
        "train.epoch_length=3",
        "train.progress_bar=false",
        "checkpoint.every=0",
        "--strategy",
        strategy,
        "--nproc",
        str(nproc),
        "--output-dir",
        str(out),
    ]
    if gpus:  # DataParallel: one process over all of them; otherwise one GPU per process
        args += ["--gpus", gpus if strategy == "dp" else ",".join(gpus.split(",")[:nproc])]
    proc = subprocess.run(
        [sys.executable, "-m", "ignite_mgpu", "train", *args], cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} on {nproc} process(es) failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small MLP (on the CPU 2 jobs at once): checks the script, not the saving",
    )
    parser.add_argument("--gpus", help="physical GPU ids (2+): run on GPUs instead of CPU processes")
    parser.add_argument("--json", type=Path, help="also write every row to this file")
    opts = parser.parse_args()
    width, depth = (256, 4) if opts.quick else (4096, 11)
    params = sum(p.numel() for p in wide_mlp(width=width, depth=depth).parameters())
    where = "GPU (peak allocated)" if opts.gpus else "process (peak RSS)"
    print(f"wide MLP {width} x {depth}: {params / 1e6:.1f}M parameters, AdamW, 3 steps; peak MB per {where}\n")
    rows = []
    jobs = [(strategy, nproc) for nproc in (1, 2) for strategy in ("ddp", "fsdp")]
    # --quick on the CPU checks the script: its small jobs, mostly start-up, run two at a time (a process's peak RSS
    # is its own, whatever runs beside it); GPUs and the full run take one job at a time.
    at_once = 2 if opts.quick and not opts.gpus else 1
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(at_once) as pool:
        done = pool.map(lambda job: run(*job, width, depth, opts.gpus, Path(tmp)), jobs)
        for (strategy, nproc), last in zip(jobs, done, strict=True):
            rows.append({"strategy": strategy, "processes": nproc, "peak_memory_mb": last["peak_memory_mb"]})
        if opts.gpus:  # DataParallel's GPU 0 for comparison: one process driving both GPUs
            last = run("dp", 1, width, depth, opts.gpus, Path(tmp))
            rows.append({"strategy": "dp", "processes": 1, "peak_memory_mb": last["peak_memory_mb"]})
    print(f"| strategy | processes | peak MB per {'GPU' if opts.gpus else 'rank'} | max |")
    print("|---|---|---|---|")
    for r in rows:
        per_rank = " / ".join(f"{m:.0f}" for m in r["peak_memory_mb"])
        print(f"| {r['strategy']} | {r['processes']} | {per_rank} | {max(r['peak_memory_mb']):.0f} |")
    ddp2, fsdp2 = (max(r["peak_memory_mb"]) for r in rows if r["processes"] == 2)
    ratio = fsdp2 / ddp2
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(f"\nFSDP / DDP on 2 processes, largest rank: {ratio:.2f} (target <= {TARGET}: {verdict})")
    if opts.json:
        opts.json.write_text(json.dumps({"parameters": params, "rows": rows, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
