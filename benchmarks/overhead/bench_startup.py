"""Start-up, measured from outside: the driver's clock just before it starts a command, to rank 0's first finished
optimizer step and to the command's exit, for the hand-written ``torch.multiprocessing.spawn`` + DDP script
(``hand_written.py``), ``ignite-mgpu train`` on the same model, data and batch, the same script under ``ignite-mgpu
run`` and under ``torchrun``; with the time line of where the start-up goes, and the time of the other CLI jobs.

Every process of a command carries the tracer (``trace/sitecustomize.py`` on PYTHONPATH), which writes each event
with the machine's clock (interpreter up, torch imported, process group, model wrapped, loop begun, first backward,
first step); nothing of the commands is changed. Each round runs every command once, in an order rotated by one
each round; the figures are the medians. Other checkouts (``--package-root``) run in the same rounds.
Run: `python benchmarks/overhead/bench_startup.py [--rounds 3] [--nproc 2] [--workloads mlp cnn] [--package-root DIR]`
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HAND = str(HERE / "hand_written.py")
TRACE_DIR = str(HERE / "trace")
EVENTS = (
    "interpreter",
    "forked",
    "torch",
    "torch._dynamo",
    "ignite",
    "process group",
    "model wrapped",
    "loop",
    "first backward",
    "first step",
)
OVERRIDES = {  # the workloads of hand_written.py, as ignite-mgpu train's overrides
    "mlp": ["model.name=mlp", "data.image_size=8", "data.batch_size=32", "data.train_size=9600", "data.val_size=64"],
    "cnn": ["model.name=simple_cnn", "data.batch_size=128", "data.train_size=3072", "data.val_size=64"],
}
COMMON = ["train.epochs=1", "checkpoint.every=0", "train.progress_bar=false"]


def console_script() -> str:
    """This environment's ``ignite-mgpu`` script, not a shell shim in front of it (PYTHONPATH decides which
    checkout it runs)."""
    local = Path(sys.executable).with_name("ignite-mgpu")
    return str(local) if local.exists() else (shutil.which("ignite-mgpu") or "ignite-mgpu")


def commands(workload: str, nproc: int, out: Path, roots: list[Path]) -> dict[str, tuple[list[str], Path]]:
    """name -> (command, the checkout on its PYTHONPATH) for one run into ``out``."""
    runs = {
        "hand-written mp.spawn": ([sys.executable, HAND, workload, str(out), "--spawn", str(nproc)], ROOT),
        "torchrun script": (
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), HAND, workload, str(out)],
            ROOT,
        ),
    }
    for i, root in enumerate(roots):
        tag = "" if i == 0 else f" [{root}]"
        train = [console_script(), "train", "--nproc", str(nproc), "--backend", "gloo", "--output-dir", str(out / "t")]
        runs[f"ignite-mgpu train{tag}"] = ([*train, *OVERRIDES[workload], *COMMON], root)
        script = [console_script(), "run", "--nproc", str(nproc), HAND, workload, str(out)]
        runs[f"ignite-mgpu run script{tag}"] = (script, root)
    return runs


def timeline(trace: Path, start: float, launcher: int) -> dict[str, float]:
    """``role event -> seconds after start`` from a trace: the launcher's events, rank 0's and its parent's where
    that is another process (a fork server)."""
    rows = [line.split(" ", 4) for line in trace.read_text().splitlines()]
    rank_of: dict[int, int] = defaultdict(lambda: -1)
    parent: dict[int, int] = {}
    for _, pid, ppid, rank, _ in rows:
        rank_of[int(pid)] = max(rank_of[int(pid)], int(rank))
        parent[int(pid)] = int(ppid)
    rank0 = [pid for pid, rank in rank_of.items() if rank == 0]
    roles = {launcher: "launcher", **{parent[pid]: "server" for pid in rank0 if parent[pid] != launcher}}
    roles |= {pid: "rank 0" for pid in rank0}
    found: dict[str, float] = {}
    for when, pid_text, _, _, name in rows:
        role = roles.get(int(pid_text))
        if role is not None and f"{role} {name}" not in found:
            found[f"{role} {name}"] = float(when) - start
    return found


def run_once(cmd: list[str], root: Path, out: Path) -> dict[str, float]:
    out.mkdir(parents=True)
    trace = out / "trace.txt"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "SLURM_", "MASTER"))
    }
    env |= {"PYTHONPATH": f"{TRACE_DIR}{os.pathsep}{root}", "BENCH_STARTUP_TRACE": str(trace), "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=600)
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    found = timeline(trace, start, proc.pid) if trace.exists() else {}
    if proc.returncode or "rank 0 first step" not in found:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{output[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return found | {"first step": found["rank 0 first step"], "whole run": end - start, "cpu": cpu}


def measure(
    tmp: Path, workload: str, nproc: int, roots: list[Path], rounds: int, only: tuple[str, ...] = ()
) -> dict[str, list[dict]]:
    """Every command (or those named in ``only``) ``rounds`` times: each run's figures (``run_once``)."""
    seen: dict[str, list[dict]] = defaultdict(list)
    for r in range(rounds):
        runs = [(k, v) for k, v in commands(workload, nproc, tmp / f"{workload}-{nproc}-{r}", roots).items()]
        runs = [(k, v) for k, v in runs if not only or k in only]
        k = r % len(runs)
        for i, (name, (_, root)) in enumerate(runs[k:] + runs[:k]):
            cmd = commands(workload, nproc, tmp / f"{workload}-{nproc}-{r}" / str(i), roots)[name][0]
            seen[name].append(run_once(cmd, root, tmp / f"{workload}-{nproc}-{r}" / str(i)))
    return seen


def med(values: list[dict], key: str) -> float | None:
    got = [v[key] for v in values if key in v]
    return statistics.median(got) if got else None


def print_workload(workload: str, nproc: int, seen: dict[str, list[dict]]) -> None:
    hand = seen["hand-written mp.spawn"]
    print(f"\n{workload}, {nproc} processes: seconds from the command's start (median; min-max)")
    print(f"  {'command':45s} {'first step':>18s} {'whole run':>18s} {'CPU s':>6s}  vs hand-written (first / whole)")
    for name, values in seen.items():
        cells = []
        for key in ("first step", "whole run"):
            got = [v[key] for v in values]
            cells.append(f"{statistics.median(got):5.2f} ({min(got):.2f}-{max(got):.2f})")
        first = med(values, "first step") / med(hand, "first step")  # type: ignore[operator]
        whole = med(values, "whole run") / med(hand, "whole run")  # type: ignore[operator]
        cpu = med(values, "cpu")
        print(f"  {name:45s} {cells[0]:>18s} {cells[1]:>18s} {cpu:6.1f}  {first:.2f}x / {whole:.2f}x", flush=True)
    print("  time line (median s; the launcher, a fork server, rank 0):")
    for name, values in seen.items():
        parts = []
        for role in ("launcher", "server", "rank 0"):
            steps = [f"{e} {t:.2f}" for e in EVENTS if (t := med(values, f"{role} {e}")) is not None]
            if steps:
                parts.append(f"{role}: " + ", ".join(steps))
        print(f"    {name}: " + " | ".join(parts))


def cli_jobs(tmp: Path, roots: list[Path], rounds: int) -> None:
    """The other commands' wall time: --help, a refusal of bad input, plan, evaluate, the default job."""
    first = tmp / "default"
    subprocess.run(
        [console_script(), "train", "--nproc", "2", "--output-dir", str(first)], check=True, capture_output=True
    )
    best = next(first.glob("best_model_*.pt"))
    bad = tmp / "corrupt.pt"
    bad.write_bytes(best.read_bytes()[:2000])
    jobs = {
        "--help": (["--help"], 0),
        "bad input (train --nproc 2 data.batch_size=0)": (["train", "--nproc", "2", "data.batch_size=0"], 2),
        "evaluate a corrupt checkpoint (--nproc 2)": (["evaluate", "--nproc", "2", "--checkpoint", str(bad)], 2),
        "plan": (["plan", "--nproc", "2"], 0),
        "evaluate the default job's best model": (["evaluate", "--nproc", "2", "--checkpoint", str(best)], 0),
        "train, the default job (README)": (["train", "--nproc", "2"], 0),
    }
    print("\nCLI jobs, whole command (median of rounds, s):")
    for label, (args, code) in jobs.items():
        cells = []
        for i, root in enumerate(roots):
            env = dict(os.environ, PYTHONPATH=str(root))
            got = []
            for r in range(rounds):
                cwd = tmp / f"cli-{i}-{r}-{len(got)}-{abs(hash(label))}"
                cwd.mkdir()
                start = time.perf_counter()
                proc = subprocess.run([console_script(), *args], cwd=cwd, env=env, capture_output=True, text=True)
                got.append(time.perf_counter() - start)
                if proc.returncode != code:
                    sys.exit(f"{label} in {root}: exit {proc.returncode}, expected {code}:\n{proc.stderr[-2000:]}")
            cells.append(f"{root}: {statistics.median(got):.2f}")
        print(f"  {label:48s} " + "; ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2])
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn"], choices=sorted(OVERRIDES))
    parser.add_argument("--package-root", type=Path, nargs="*", default=[], help="other checkouts to measure too")
    parser.add_argument("--no-cli", action="store_true", help="leave out the other CLI jobs")
    opts = parser.parse_args()
    roots = [ROOT, *opts.package_root]
    print(f"{os.cpu_count()} CPUs; load average before {os.getloadavg()[0]:.2f}; {opts.rounds} round(s)")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as name:
        for nproc in opts.nproc:
            for workload in opts.workloads:
                print_workload(workload, nproc, measure(Path(name), workload, nproc, roots, opts.rounds))
        if not opts.no_cli:
            cli_jobs(Path(name), roots, opts.rounds)
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
