"""What ignite-mgpu costs over a hand-written PyTorch DDP loop, on 2 gloo processes with one thread each.

Measures, with (a) a hand-written loop and (b) ``ignite_mgpu.train.default_job.training`` as ``ignite-mgpu train`` runs
it: time per iteration on a tiny MLP and on the default small CNN, 2-vs-1 process scaling, launch to the first finished
iteration, ``ignite-mgpu --help``, and the extra Python calls per iteration (cProfile, rank 0). (a) and (b) take turns
inside one run of (b), in the same worker processes; a ratio is printed only when their final weights are bit-identical,
which proves that both did the same work.

Measured by the modules beside this script: loops (the loops), session (the worker sessions, call counts),
startup (start-up, --help) and report (statistics, tables).

Run: python benchmarks/overhead/bench_overhead.py [--rounds 5] [--iters N] [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Set before torch is imported in this process or any process it starts: one thread per process.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
# The helpers import as benchmarks.<folder>.<module> from the repository root: here, in the processes that re-run
# this script (sessions) and in the workers that unpickle them (spawn copies sys.path). None imports torch at module
# level.
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.overhead.loops import WORKLOADS
from benchmarks.overhead.report import machine, report
from benchmarks.overhead.session import MEASURED_EPOCHS, run_session, session_main
from benchmarks.overhead.startup import help_seconds, time_to_first_iteration


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs per workload and process count [5]")
    parser.add_argument("--iters", type=int, help="iterations per measured epoch [mlp 500, cnn 40]")
    parser.add_argument("--quick", action="store_true", help="one short round, MLP and CNN on 2 procs only")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    parser.add_argument("--no-pin", action="store_true", help="leave the processes unpinned (default: 1 core each)")
    parser.add_argument("--session", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.session:
        session_main(args.session)
        return 0

    rounds, epochs = (1, 1) if args.quick else (args.rounds, MEASURED_EPOCHS)
    pin = not args.no_pin
    iters = {w: args.iters or spec[3 if args.quick else 2] for w, spec in WORKLOADS.items()}
    load_before = open("/proc/loadavg").read().split()[:3]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as name:
        tmp = Path(name)
        profile = ["mlp"] if args.quick else ["mlp", "cnn"]
        sessions = {2: run_session(tmp, 2, ["mlp", "cnn"], rounds, iters, epochs, profile, pin)}
        if not args.quick:
            sessions[1] = run_session(tmp, 1, ["cnn", "mlp"], rounds, iters, epochs, [], pin)
        startup = None if args.quick else time_to_first_iteration(tmp, rounds)
        help_s = help_seconds(rounds)
    table, summary = report(sessions, startup, help_s, args.quick)
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"Machine: {machine()}")
    pinned = sessions[2].get("core") is not None
    print("Each process pinned to a core of its own" if pinned else "Processes not pinned to cores")
    print(
        f"Load average (1/5/15 min) before {'/'.join(load_before)}, after {'/'.join(load_after)}; "
        f"{rounds} round(s), iterations per measured epoch {iters}, {time.perf_counter() - started:.0f} s\n"
    )
    print(table)
    counts = ", ".join(f"{k} procs: {v['identical']}" for k, v in summary["per_iteration"].items())
    if summary["refused"]:
        print(f"\nBitwise check FAILED: final weights differ. Identical runs: {counts}.")
        print("No ratio for: " + "; ".join(summary["refused"]) + ". (a) and (b) did not do the same work.")
    else:
        print(f"\nBitwise check passed: final weights of hand-written and ignite-mgpu bit-identical ({counts}).")
    calls = summary["calls"]
    for workload, c in calls.items():
        print(
            f"Most extra calls per iteration, {WORKLOADS[workload][0]}: "
            + ", ".join(f"{k} +{v:g}" for k, v in c["top_extra"][:8])
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary | {"machine": machine(), "iters": iters}, indent=2))
    return 1 if summary["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
