"""FSDP's training step and evaluation per batch: ignite-mgpu against hand-written loops, on 2 gloo processes.

- step: a tiny GPT-2 (built from its config) under ``--strategy fsdp``: ignite-mgpu's ``training`` against a
  hand-written FSDP2 loop with the same ``fully_shard`` calls, model, data, AdamW, schedule and clipping; the
  loops take turns inside one run of ``training`` (overhead/'s harness), and a ratio is printed only when their
  final weights are bit-identical.
- eval: ignite-mgpu's evaluator against a hand-written ``torch.no_grad()`` loop computing the same metrics (loss,
  and accuracy for the small CNN) with one all-reduce at the end, on the same prepared model (the small CNN under
  DDP, the tiny GPT-2 under FSDP); passes take turns, and the metrics of each pair of passes must be equal.

Run: python benchmarks/fsdp/bench_fsdp_step.py [--rounds 5] [--passes 40] [--only step,eval] [--eval-workloads gpt2,cnn]
                                               [--quick] [--json P]
     python benchmarks/fsdp/bench_fsdp_step.py --quick            # about 40 s: the checks only, timings meaningless
     python benchmarks/fsdp/bench_fsdp_step.py --instructions     # step and evaluation counted under callgrind

``--rounds 3 --passes 30`` took 20 minutes on 2 cores under a load of 3 to 11 (a GPT-2 step of about 0.3 s
unloaded). The figures of record: benchmarks/results/fsdp_eval_step_<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported here or in any process started from here
os.environ["MKL_NUM_THREADS"] = "1"
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fsdp import eval_loops, step_loops  # after sys.path
from benchmarks.fsdp.step_report import report

MEASURED_EPOCHS = 3
TURNS_PER_EPOCH = 5


def step_rounds(local_rank: int, spec: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """Rounds of (b) ``training`` with (a) the hand-written FSDP2 loop taking turns in it; rank 0's records."""
    import gc

    from benchmarks.overhead.loops import Turns, bitwise_difference, finish, ignite_run
    from benchmarks.overhead.session import window_size

    iters = spec["iters"]
    window = window_size(iters)
    runs = []
    for r in range(spec["rounds"]):
        cfg = step_loops.make_config("gpt2", iters, 1 + spec["epochs"], Path(spec["dir"]) / f"gpt2-{r}", 2)
        others = {"hand-written": step_loops.hand_steps(step_loops.hand_built(cfg), cfg.train.epochs, window)}
        turns = Turns(others, window)
        state_b = ignite_run(local_rank, cfg, turns)
        state_a = finish(others["hand-written"])  # every rank: the full state dict is gathered
        gc.collect()
        if rank == 0:
            assert state_b is not None
            difference = bitwise_difference(state_a, state_b)
            runs.append(
                {"workload": "gpt2", "round": r, "window": window, "difference": difference} | {"turns": turns.turns}
            )
    return runs


def eval_rounds(spec: dict[str, Any]) -> dict[str, Any]:
    """Each evaluation workload: its passes taking turns; rank 0's records."""
    import ignite.distributed as idist

    out = {}
    for workload in spec["eval_workloads"]:
        cfg = eval_loops.make_config(workload, spec["val"][workload], Path(spec["dir"]) / f"eval-{workload}", 2)
        parts = eval_loops.built(cfg)
        times, differences = eval_loops.evaluation_turns(parts, spec["passes"])
        if idist.get_rank() == 0:
            out[workload] = {"turns": times, "window": len(parts["val_loader"]), "differences": differences}
    return out


def session_worker(local_rank: int, spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.overhead.session import pin_to_core

    torch.set_num_threads(1)
    rank = dist.get_rank()
    core = pin_to_core(rank, 2) if spec["pin"] else None
    results: dict[str, Any] = {"core": core, "runs": [], "eval": {}}
    if spec["rounds"]:
        results["runs"] = step_rounds(local_rank, spec, rank)
    if spec["eval_workloads"]:
        results["eval"] = eval_rounds(spec)
    if rank == 0:
        Path(spec["dir"], "results.json").write_text(json.dumps(results))


def run_session(spec: dict[str, Any]) -> dict[str, Any]:
    """One launch of 2 gloo processes in a fresh interpreter; rank 0's results."""
    log = Path(spec["dir"], "session.log")
    with log.open("w") as f:
        code = subprocess.call([sys.executable, __file__, "--session", json.dumps(spec)], stdout=f, stderr=f)
    if code:
        sys.exit(f"benchmark session failed (exit {code}); its log:\n{log.read_text()[-4000:]}")
    return json.loads(Path(spec["dir"], "results.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of the step comparison [5]")
    parser.add_argument("--iters", type=int, help=f"iterations per measured epoch [{step_loops.WORKLOADS['gpt2'][1]}]")
    parser.add_argument("--passes", type=int, default=40, help="validation passes per loop and workload [40]")
    parser.add_argument("--only", default="step,eval", help="comma-separated: step, eval [step,eval]")
    parser.add_argument(
        "--eval-workloads", default=",".join(eval_loops.WORKLOADS), help="the evaluations to compare [gpt2,cnn]"
    )
    parser.add_argument("--quick", action="store_true", help="one short round and a few passes: the checks only")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    parser.add_argument("--no-pin", action="store_true", help="leave the processes unpinned")
    parser.add_argument("--instructions", action="store_true", help="count the step's instructions (callgrind)")
    parser.add_argument("--session", help=argparse.SUPPRESS)
    parser.add_argument("--inside", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.session:
        from ignite_mgpu import launch

        spec = json.loads(args.session)
        launch(session_worker, spec, nproc=2, backend="gloo")
        return 0
    if args.instructions or args.inside:
        from benchmarks.fsdp.step_instructions import instructions_main

        return instructions_main(args.inside, args.quick)
    only = set(args.only.split(","))
    quick = args.quick
    spec = {
        "rounds": (1 if quick else args.rounds) if "step" in only else 0,
        "iters": args.iters or step_loops.WORKLOADS["gpt2"][2 if quick else 1],
        "epochs": 1 if quick else MEASURED_EPOCHS,
        "passes": 4 if quick else args.passes,
        "eval_workloads": [w for w in eval_loops.WORKLOADS if "eval" in only and w in args.eval_workloads.split(",")],
        "val": {w: v[2 if quick else 1] for w, v in eval_loops.WORKLOADS.items()},
        "pin": not args.no_pin,
    }
    load_before = open("/proc/loadavg").read().split()[:3]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-step-") as tmp:
        spec["dir"] = tmp
        results = run_session(spec)
    text, summary = report(results, spec, load_before, time.perf_counter() - started)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(summary | {"spec": spec}, indent=2))
    return 1 if summary["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
