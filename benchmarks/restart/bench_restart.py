"""How fast a job stops after a failure and heals itself (issue #14): from a rank's failure to every worker of the
job stopped, and from a SIGKILL to the first iteration of the restarted group, with the iterations lost.

Runs the real CLI (2 gloo processes, the fault model of tests/faults/faultmod.py, which notes the time of the
fault and of each process's first training steps) and samples the workers' pids every 5 ms.
Run: `python benchmarks/restart/bench_restart.py [--repeat 5] [--package-root DIR] [--restart-only]` (about 10 s per
job on 2 cores);
``--package-root`` measures another checkout (e.g. the release before restarts existed) with the same fault model.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ROOT / "tests" / "faults"
JOB = [
    "train",
    "--nproc",
    "2",
    "--backend",
    "gloo",
    "model.name=faultmod:make",
    "data.train_size=1280",  # 20 iterations of a global batch of 64
    "data.val_size=100",
    "data.batch_size=64",
    "train.epochs=1",
    "train.progress_bar=false",
    "checkpoint.every_iters=5",
]
FAULT_AT = 13  # the faulty rank's 13th training step: after checkpoint_10
NAMES = {"raise": "exception", "hang": "exception, other rank busy", "kill": "SIGKILL"}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def lines(folder: Path, name: str) -> list[list[str]]:
    path = folder / name
    return [ln.split() for ln in path.read_text().splitlines()] if path.is_file() else []


def measure(kind: str, restarts: int, package_root: Path) -> dict[str, float | str]:
    """One job with rank 1 failing (``kind``: raise or kill) in its FAULT_AT-th step; ``hang`` also hangs rank 0
    in that step (busy outside any collective, so it does not notice the failure by itself)."""
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        pids_dir = Path(tmp, "pids")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
        env.update(
            PYTHONPATH=f"{FAULTS}{os.pathsep}{package_root}",
            PIDS_DIR=str(pids_dir),
            FAULT=f"once-raise:1:{FAULT_AT},once-sleep:0:{FAULT_AT}" if kind == "hang" else f"once-{kind}:1:{FAULT_AT}",
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            TMPDIR=tmp,
        )
        args = [*JOB, "--output-dir", str(Path(tmp, "out"))]
        if restarts:
            args += ["--max-restarts", str(restarts)]
        stopped: list[float] = []

        def watch() -> None:  # the first attempt's workers, until every one is gone
            while not (pids_dir / "fault1").is_file():
                if proc.poll() is not None:
                    return
                time.sleep(0.005)
            first = [int(lines(pids_dir, f"rank{r}")[0][0]) for r in (0, 1)]
            while not all(gone(pid) for pid in first):
                time.sleep(0.005)
            stopped.append(time.time())

        proc = subprocess.Popen(
            [sys.executable, "-m", "ignite_mgpu", *args],
            env=env,
            cwd=tmp,  # not a checkout: `python -m` would import the package of the working directory
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _, err = proc.communicate(timeout=300)
        watcher.join(timeout=10)
        fault = float(lines(pids_dir, "fault1")[0][1])
        result: dict[str, float | str] = {"rc": proc.returncode, "stopped_s": stopped[0] - fault}
        if restarts:
            first_pids = {lines(pids_dir, f"rank{r}")[0][0] for r in (0, 1)}
            # A restarted rank starts its second step once the group has finished its first iteration.
            seconds = [
                float(t)
                for r in (0, 1)
                for pid, call, t in lines(pids_dir, f"forward{r}")
                if pid not in first_pids and call == "2"
            ]
            result["first_iteration_s"] = min(seconds) - fault if seconds else float("nan")
            m = re.search(r"(\d+) iteration\(s\) lost", err)
            result["lost"] = m.group(1) if m else "?"
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--package-root", type=Path, default=ROOT, help="the checkout whose ignite_mgpu runs")
    parser.add_argument("--restart-only", action="store_true", help="only the last row (SIGKILL, max_restarts=1)")
    opts = parser.parse_args()
    cases = [("kill", 1)] if opts.restart_only else [("raise", 0), ("hang", 0), ("kill", 0), ("kill", 1)]
    schema = opts.package_root / "ignite_mgpu" / "config" / "schema.py"
    if "max_restarts" not in (schema if schema.is_file() else schema.parent.with_suffix(".py")).read_text():
        cases = cases[:3]  # a release before restarts
    print(f"package: {opts.package_root}; load average {os.getloadavg()[0]:.2f}; {opts.repeat} job(s) per row")
    for kind, restarts in cases:
        results = [measure(kind, restarts, opts.package_root) for _ in range(opts.repeat)]
        stopped = [float(r["stopped_s"]) for r in results]
        row = (
            f"{NAMES[kind]:28s} max_restarts={restarts}: exit {results[0]['rc']}; "
            f"failure -> every worker stopped: median {statistics.median(stopped):.2f} s "
            f"(min {min(stopped):.2f}, max {max(stopped):.2f})"
        )
        if restarts:
            first = [float(r["first_iteration_s"]) for r in results]
            row += (
                f"; kill -> first iteration of the restarted group: median {statistics.median(first):.2f} s "
                f"(min {min(first):.2f}, max {max(first):.2f}); iterations lost: {sorted({r['lost'] for r in results})}"
            )
        print(row, flush=True)


if __name__ == "__main__":
    main()
