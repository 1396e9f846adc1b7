"""bench_fsdp_step.py --instructions: the FSDP step counted in instructions per iteration under valgrind's callgrind,
hand-written FSDP2 loop against ignite-mgpu's ``training``, on 2 gloo processes (FSDP on one process shards
nothing). As instructions/bench_instructions.py does for DDP: callgrind counts only a window of iterations in the
middle of the epoch (toggled from Python), every thread of each process; the count does not depend on the machine's
load. The guard's collective check runs every ``check_every`` iterations (one check in the window)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.fsdp import eval_loops, step_loops

LOOPS = ("hand-written", "ignite-mgpu")
PLAN = (4, 8)  # warm-up iterations, counted window (the guard checks once in it: check_every = the window)
QUICK = (2, 2)
EVAL_PASSES = 2  # counted passes of each evaluation loop, after one warm-up pass (--quick: 1)
# Validation samples: 4 batches per process and pass (a quarter of the wall-time benchmark's passes: under valgrind a
# CNN forward takes seconds), so the pass's fixed costs weigh 4x as much per batch as there.
EVAL_VAL = {"cnn": 512, "gpt2": 64}
TOTALS = re.compile(r"^(?:summary|totals): (\d+)", re.M)


def hand_loop(cfg: Any, at: Any) -> dict[str, Any]:
    """step_loops' hand-written FSDP2 loop, with the toggle after every iteration; the final (full) weights."""
    built = step_loops.hand_built(cfg)
    steps = step_loops.hand_steps(built, cfg.train.epochs, 1)
    done = 0
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        done += 1
        at(done)


def run_loops(local_rank: int, spec: dict[str, Any]) -> None:
    """Both loops in turn, each dumping one file of its window's counts; rank 0 compares the final weights."""
    import torch
    import torch.distributed as dist

    from benchmarks.instructions.bench_instructions import ignite_mgpu_loop, toggler
    from benchmarks.overhead.loops import bitwise_difference

    torch.set_num_threads(1)
    root = Path(spec["dir"])
    rank = dist.get_rank()
    Path(root, f"rank{rank}.pid").write_text(str(os.getpid()))
    warmup, window = spec["plan"]
    final = {}
    for loop in LOOPS:
        cfg = step_loops.make_config("gpt2", warmup + window + 1, 1, root / loop, 2)
        cfg.train.check_every = window
        run = hand_loop if loop == "hand-written" else ignite_mgpu_loop
        final[loop] = run(cfg, toggler(warmup, warmup + window))
    evaluation = {w: count_evaluation(w, spec, root) for w in eval_loops.WORKLOADS}
    if rank == 0:
        difference = bitwise_difference(final["hand-written"], final["ignite-mgpu"])
        Path(root, "difference.json").write_text(json.dumps({"step": difference, "eval": evaluation}))


def count_evaluation(workload: str, spec: dict[str, Any], root: Path) -> dict[str, Any]:
    """One warm-up pass, then ``spec["passes"]`` counted passes (one dump) of each evaluation loop in turn; the
    batches per pass and whether the metrics of the last passes differed."""
    import torch

    cfg = eval_loops.make_config(workload, spec["val"][workload], root / f"eval-{workload}", 2)
    parts = eval_loops.built(cfg)
    results = {}
    for name, evaluate in eval_loops.loops_of(parts).items():
        evaluate()
        torch._C._valgrind_toggle()
        for _ in range(spec["passes"]):
            results[name] = evaluate()
        torch._C._valgrind_toggle_and_dump_stats()
    return {"batches": len(parts["val_loader"]), "difference": eval_loops.difference(results)}


def counts(tmp: Path, windows: list[tuple[str, str, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """Instructions per unit (iteration, batch) of each rank, part and loop, from each rank's numbered dumps, one
    per ``(part, loop, units)`` of ``windows`` in run order."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    for rank in range(2):
        pid = Path(tmp, f"rank{rank}.pid").read_text().strip()
        dumps = sorted(tmp.glob(f"callgrind.out.{pid}.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        if len(dumps) != len(windows):
            sys.exit(f"rank {rank}: callgrind wrote {len(dumps)} window dumps, expected {len(windows)}")
        for (part, loop, units), path in zip(windows, dumps, strict=True):
            match = TOTALS.search(path.read_text(errors="replace"))
            if match is None:
                sys.exit(f"no totals in {path}")
            result.setdefault(part, {}).setdefault(f"rank {rank}", {})[loop] = int(match[1]) / units
    return result


def instructions_main(inside: str | None, quick: bool) -> int:
    """Run every loop under callgrind in 2 gloo processes, then print the table; 1 when a check failed."""
    if inside:
        from ignite_mgpu import launch

        launch(run_loops, json.loads(inside), nproc=2, backend="gloo", timeout=1800.0)
        return 0
    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (Debian: apt-get install valgrind).", file=sys.stderr)
        return 2
    plan = QUICK if quick else PLAN
    passes = 1 if quick else EVAL_PASSES
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-instructions-") as name:
        spec = {"dir": name, "plan": plan, "passes": passes,
                "val": EVAL_VAL}  # fmt: skip
        argv = ["valgrind", "--tool=callgrind", "--trace-children=yes", "--instr-atstart=yes", "--collect-atstart=no",
                f"--callgrind-out-file={name}/callgrind.out.%p", sys.executable,
                str(Path(__file__).with_name("bench_fsdp_step.py")), "--inside", json.dumps(spec)]  # fmt: skip
        log = Path(name, "valgrind.log")
        with log.open("w") as f:
            code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONHASHSEED": "0"})
        if code:
            print(f"the run under valgrind failed (exit {code}):\n{log.read_text()[-3000:]}", file=sys.stderr)
            return 1
        checks = json.loads(Path(name, "difference.json").read_text())
        windows = [("step", loop, float(plan[1])) for loop in LOOPS]
        windows += [(w, loop, float(passes * e["batches"])) for w, e in checks["eval"].items() for loop in LOOPS]
        result = counts(Path(name), windows)
    from benchmarks.overhead.report import machine

    print(f"Machine: {machine()}, {time.perf_counter() - started:.0f} s\n")
    print("\n".join(table(result, checks, plan, passes)))
    if quick:
        print("\n(--quick: tiny windows; the counts are not meaningful, only that it runs)")
    failed = checks["step"] or any(e["difference"] for e in checks["eval"].values())
    return 1 if failed else 0


def table(result: dict[str, Any], checks: dict[str, Any], plan: tuple[int, int], passes: int) -> list[str]:
    """One row per part (the step, each evaluation) and rank; no ratio where the check failed."""
    lines = [
        "| part | rank | counted | hand-written | ignite-mgpu | difference | ratio | target ≤ 1.02 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for part, ranks in result.items():
        if part == "step":
            title, counted, failed = (
                f"{step_loops.WORKLOADS['gpt2'][0]} step, per iteration",
                f"{plan[1]} it",
                checks[part],
            )
        else:
            e = checks["eval"][part]
            title, failed = f"evaluation, {eval_loops.WORKLOADS[part][0]}, per batch", e["difference"]
            counted = f"{passes} passes of {e['batches']} batches"
        for rank, c in ranks.items():
            a, b = c["hand-written"], c["ignite-mgpu"]
            cells = f"{a / 1e6:.3f} M | {b / 1e6:.3f} M | {(b - a) / 1e3:+.1f} k | {b / a:.4f}"
            met = "met" if b / a <= 1.02 else "**not met**"
            if failed:
                cells, met = f"refused: {failed} | | |", ""
            lines.append(f"| {title} | {rank.split()[1]} | {counted} | {cells} | {met} |")
    lines.append(
        f"\nInstructions of each process (2 gloo processes, 1 thread each; every thread counted): the step in a window "
        f"of {plan[1]} iterations after {plan[0]} of warm-up (the guard checks once in it), each evaluation loop over "
        f"{passes} whole passes after one of warm-up (per batch: the pass's fixed costs, the final all-reduces "
        f"included, spread over its batches). Final weights bit-identical: {'**no**' if checks['step'] else 'yes'}; "
        "evaluation metrics equal: "
        + ", ".join(f"{w}: {'**no**' if e['difference'] else 'yes'}" for w, e in checks["eval"].items())
        + "."
    )
    return lines
