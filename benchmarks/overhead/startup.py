"""Start-up figures: launch to the first finished iteration, hand-written (``reference_worker``, spawned by
bench_overhead.py --reference-spawn) against ``ignite-mgpu train``, and the time of ``ignite-mgpu --help``."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.overhead.loops import LOOPS
from benchmarks.overhead.session import ENTRY_SCRIPT


def reference_worker(rank: int, out: str, world_size: int = 2) -> None:
    """The hand-written spawn script's worker: the default job's model and data, one DDP iteration."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ignite_mgpu.train.models import SimpleCNN

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 3, 32, 32, generator=g), torch.randint(10, (4096,), generator=g))
    model = nn.parallel.DistributedDataParallel(SimpleCNN(num_classes=10))  # the default job's model
    sampler = DistributedSampler(data, world_size, rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sampler.set_epoch(0)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    if rank == 0:
        Path(out, "first_iteration").write_text("done\n")
    dist.barrier()  # neither rank tears gloo down while the other may still be sending
    dist.destroy_process_group()


def console_script() -> str:
    """The ``ignite-mgpu`` script of this interpreter's environment (not a shell shim in front of it)."""
    local = Path(sys.executable).with_name("ignite-mgpu")
    return str(local) if local.exists() else (shutil.which("ignite-mgpu") or "ignite-mgpu")


def time_to_first_iteration(tmp: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds from starting the command to rank 0 finishing its first iteration (a marker file's mtime), and
    the CPU seconds the whole command used in all its processes (which other load on the machine barely changes).

    ignite-mgpu's marker is metrics.jsonl, written after its one-iteration epoch plus a 2-sample validation.
    """
    found: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in LOOPS}, "cpu": {n: [] for n in LOOPS}}
    for r in range(rounds):
        for name in LOOPS if r % 2 == 0 else LOOPS[::-1]:
            out = tmp / f"startup-{name}-{r}"
            if name == "hand-written":
                out.mkdir()
                cmd, marker = [sys.executable, ENTRY_SCRIPT, "--reference-spawn", str(out)], out / "first_iteration"
            else:
                cmd = [
                    console_script(),
                    "train",
                    "--nproc",
                    "2",
                    "--backend",
                    "gloo",
                    "--output-dir",
                    str(out),
                    "train.epochs=1",
                    "train.epoch_length=1",
                    "data.val_size=2",
                    "checkpoint.every=0",
                    "train.progress_bar=false",
                ]
                marker = out / "metrics.jsonl"
            cpu = resource.getrusage(resource.RUSAGE_CHILDREN)  # children and grandchildren once waited for
            start = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode or not marker.exists():
                sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            found["wall"][name].append(marker.stat().st_mtime - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            found["cpu"][name].append(after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime)
    return found


def help_seconds(rounds: int) -> list[float]:
    found = []
    for _ in range(max(3, rounds)):
        start = time.perf_counter()
        subprocess.run([console_script(), "--help"], capture_output=True, check=True)
        found.append(time.perf_counter() - start)
    return found
