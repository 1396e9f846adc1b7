"""The per-iteration criterion counted in instructions: what ignite-mgpu's ``training`` executes per iteration over
ignite's bare ``Engine`` running the same step (and a hand-written loop), under valgrind's callgrind.

Wall time on a shared 2-core VM moves by more than the criterion's margin (1.01) even over interleaved rounds
(benchmarks/README.md has the figures). Instructions do not depend on the machine's load: the same code, inputs and
environment count the same total whether or not the other core is busy, so one run decides what ignite-mgpu adds to
the step's CPU work. Each loop trains overhead/bench_overhead.py's workloads (same config, model, data and seed) in
one process with one thread; callgrind counts only a window of iterations in the middle of the epoch (toggled from
Python), after warm-up and before the epoch's end (validation, report, checkpoint: not per-iteration work, left out
for every loop). The guard's collective check runs at its native rate (``train.check_every``: about once a second
natively; under valgrind a step is ~50x slower, so the automatic interval would check far too often), and the checks
inside the window are counted. What a second process adds (gloo's all-reduce, the other rank's wake-ups) is the same
for every loop and only grows the denominator, so the one-process ratio bounds the two-process one from above.

Run: python benchmarks/instructions/bench_instructions.py [--workloads mlp,cnn] [--quick] [--set KEY=VALUE]
     (needs valgrind; --set: an override of ignite-mgpu's job, e.g. checkpoint.async_save=false)
"""

from __future__ import annotations

import argparse
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

os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool: one thread, no pool to count
os.environ["MKL_NUM_THREADS"] = "1"
# The helpers import as benchmarks.<folder>.<module> from the repository root, here and in the workers (spawn copies
# sys.path).
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LOOPS = ("hand-written", "ignite Engine", "ignite-mgpu")
# workload -> (warm-up iterations, counted window, check_every); each window holds one check of the guard. For the
# tiny MLP that is its native interval on 2 processes (about 1 s of 2 ms steps); the CNN's native one is about 50
# (20 ms steps), but under valgrind its step takes ~20 s (oneDNN's generated kernels are slow to instrument), so its
# window is short and checks 8x as often as natively: its figure overstates ignite-mgpu's cost a little.
PLAN = {"mlp": (100, 500, 500), "cnn": (3, 6, 6)}
QUICK = {"mlp": (3, 6, 4), "cnn": (2, 2, 2)}
TARGET = 1.01  # the per-iteration criterion: ignite-mgpu over ignite's bare Engine
TOTALS = re.compile(r"^(?:summary|totals): (\d+)", re.M)


def toggler(start: int, stop: int) -> Any:
    """A function of the iteration count that switches callgrind's collection on after iteration ``start`` and off
    (dumping a file of the window's counts) after iteration ``stop``."""
    import torch

    def at(iteration: int) -> None:
        if iteration == start:
            torch._C._valgrind_toggle()
        elif iteration == stop:
            torch._C._valgrind_toggle_and_dump_stats()

    return at


def hand_loop(cfg: Any, at: Any) -> dict[str, Any]:
    """overhead/bench_overhead.py's hand-written loop, with the toggle after every iteration; the final weights."""
    from benchmarks.overhead.loops import hand_built, weights

    sampler, loader, model, net, optimizer, scheduler, loss_fn = hand_built(cfg)
    model.train()
    done = 0
    for epoch in range(cfg.train.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            done += 1
            at(done)
    return weights(net)


def engine_loop(cfg: Any, at: Any) -> dict[str, Any]:
    """The same step in ignite's bare Engine; the toggle is one plain ITERATION_COMPLETED handler."""
    from ignite.engine import Engine, Events

    from benchmarks.overhead.loops import engine_step, hand_built, weights

    built = hand_built(cfg)
    sampler, loader, model, net = built[:4]
    engine = Engine(engine_step(built))
    engine.add_event_handler(Events.EPOCH_STARTED, lambda e: sampler.set_epoch(e.state.epoch - 1))
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: at(e.state.iteration))
    model.train()
    engine.run(loader, max_epochs=cfg.train.epochs)
    return weights(net)


def ignite_mgpu_loop(cfg: Any, at: Any) -> dict[str, Any] | None:
    """``ignite_mgpu.train.default_job.training`` with every default handler, and the same toggle handler on its
    trainer; the
    final weights, from the checkpoint written after the epoch (``checkpoint.every``: the last epoch)."""
    import ignite.distributed as idist
    from ignite.engine import Events

    import ignite_mgpu.train.default_job
    from ignite_mgpu.checkpoint.files import read_checkpoint

    create_trainer = ignite_mgpu.train.default_job.create_trainer

    def with_toggle(*args: Any, **kwargs: Any) -> Any:
        trainer = create_trainer(*args, **kwargs)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: at(e.state.iteration))
        return trainer

    ignite_mgpu.train.default_job.create_trainer = with_toggle  # type: ignore[assignment]  # same signature
    try:
        ignite_mgpu.train.default_job.training(0, cfg)
    finally:
        ignite_mgpu.train.default_job.create_trainer = create_trainer
    if idist.get_rank() != 0:
        return None  # rank 0 writes the checkpoint and compares the weights
    (final,) = Path(cfg.output_dir).glob("checkpoint_*.pt")
    return read_checkpoint(final)["model"]


RUNNERS = {"hand-written": hand_loop, "ignite Engine": engine_loop, "ignite-mgpu": ignite_mgpu_loop}


def run_loops(local_rank: int, spec: dict[str, Any]) -> None:
    """Every (workload, loop) in order, each dumping one file of its window's counts; the ranks run them in step
    (DDP's all-reduce in every backward keeps them together). Rank and pid go to a file: the dumps are per pid."""
    import torch
    import torch.distributed as dist

    from benchmarks.overhead.loops import bitwise_difference, make_config

    torch.set_num_threads(1)
    root, nproc = Path(spec["dir"]), spec["nproc"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(root, f"rank{rank}.pid").write_text(str(os.getpid()))
    differences = {}
    for workload in spec["workloads"]:
        warmup, window, check_every = spec["plan"][workload]
        iters = warmup + window + 1  # the epoch ends one iteration after the window: its end is never counted
        final = {}
        for loop in LOOPS:
            extra = spec.get("overrides", []) if loop == "ignite-mgpu" else []
            cfg = make_config(workload, iters, 1, root / f"{workload}-{loop.replace(' ', '_')}", nproc, extra)
            cfg.train.check_every = check_every
            final[loop] = RUNNERS[loop](cfg, toggler(warmup, warmup + window))
        # The same final weights, bit for bit: the three loops did the same work (else no ratio is printed).
        if rank == 0:
            differences[workload] = [d for loop in LOOPS[1:] if (d := bitwise_difference(final[LOOPS[0]], final[loop]))]
    if rank == 0:
        Path(root, "differences.json").write_text(json.dumps(differences))


def inside(spec: dict[str, Any]) -> None:
    """Under callgrind: the loops in this process, or in ``nproc`` gloo processes started by ``ignite_mgpu.launch``
    (valgrind follows them into the children)."""
    if spec["nproc"] == 1:
        run_loops(0, spec)
        return
    from ignite_mgpu import launch

    launch(run_loops, spec, nproc=spec["nproc"], backend="gloo", timeout=1800.0)  # valgrind: ~50x slower steps


def parse_dumps(out_dir: Path, spec: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Instructions per iteration of each rank, workload and loop, from each rank's numbered dump files (one per
    window, in run order: ``callgrind.out.<pid>.<n>``)."""
    windows = [(w, loop) for w in spec["workloads"] for loop in LOOPS]
    result: dict[str, dict[str, dict[str, float]]] = {}
    for rank in range(spec["nproc"]):
        pid = Path(out_dir, f"rank{rank}.pid").read_text().strip()
        dumps = sorted(out_dir.glob(f"callgrind.out.{pid}.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        if len(dumps) != len(windows):
            sys.exit(f"rank {rank}: callgrind wrote {len(dumps)} window dumps, expected {len(windows)}")
        for (workload, loop), path in zip(windows, dumps, strict=True):
            match = TOTALS.search(path.read_text(errors="replace"))
            if match is None:
                sys.exit(f"no totals in {path}")
            per_iteration = int(match[1]) / spec["plan"][workload][1]
            result.setdefault(f"rank {rank}", {}).setdefault(workload, {})[loop] = per_iteration
    return result


def report(
    result: dict[str, dict[str, dict[str, float]]], plan: dict[str, Any], nproc: int, differences: dict[str, list]
) -> list[str]:
    """The table: one row per rank and workload; no ratio for a workload whose loops ended with other weights."""
    titles = {"mlp": "tiny MLP", "cnn": "small CNN"}
    lines = [
        "| workload | rank | window | hand-written | ignite Engine | ignite-mgpu | ignite-mgpu − bare Engine | "
        f"ignite-mgpu / bare Engine | target ≤ {TARGET} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, workloads in result.items():
        for workload, counts in workloads.items():
            a, e, b = (counts[loop] for loop in LOOPS)
            ratio = b / e
            if differences[workload]:
                lines.append(f"| {titles[workload]} | {rank.split()[1]} | refused: {differences[workload][0]} |")
                continue
            lines.append(
                f"| {titles[workload]} | {rank.split()[1]} | {plan[workload][1]} it | {a / 1e6:.3f} M | "
                f"{e / 1e6:.3f} M | {b / 1e6:.3f} M | {(b - e) / 1e3:+.1f} k | {ratio:.4f} | "
                f"{'met' if ratio <= TARGET else '**not met**'} |"
            )
    checks = ", ".join(f"{titles[w]} every {p[2]} iterations" for w, p in plan.items())
    lines.append(
        f"\nInstructions per iteration of each process ({nproc} gloo process(es), 1 thread each; callgrind counts "
        f"every thread of a process), in a window of iterations mid-epoch; the guard checks {checks} and those "
        f"checks are counted (natively about once a second). Final weights of the three loops bit-identical: "
        + ", ".join(f"{titles[w]}: {'**no**' if d else 'yes'}" for w, d in differences.items())
        + "."
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, choices=(1, 2), default=2, help="gloo processes [2]")
    parser.add_argument("--workloads", default="mlp,cnn", help="comma-separated: mlp, cnn [mlp,cnn]")
    parser.add_argument("--quick", action="store_true", help="tiny windows: checks that it runs, counts meaningless")
    parser.add_argument("--json", metavar="PATH", help="also write the counts as JSON to PATH")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of ignite-mgpu's job"
    )
    parser.add_argument("--inside", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(json.loads(args.inside))
        return 0
    if shutil.which("valgrind") is None:
        print("bench_instructions.py needs valgrind (Debian: apt-get install valgrind).", file=sys.stderr)
        return 2
    workloads = [w for w in args.workloads.split(",") if w]
    plan = {w: (QUICK if args.quick else PLAN)[w] for w in workloads}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        spec = {"dir": tmp, "nproc": args.nproc, "workloads": workloads, "plan": plan, "overrides": args.set}
        argv = [
            "valgrind",
            "--tool=callgrind",
            "--trace-children=yes",  # into the spawned workers
            "--instr-atstart=yes",
            "--collect-atstart=no",  # counted only between the toggles
            f"--callgrind-out-file={tmp}/callgrind.out.%p",
            sys.executable,
            __file__,
            "--inside",
            json.dumps(spec),
        ]
        log = Path(tmp, "valgrind.log")
        with log.open("w") as f:
            code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONHASHSEED": "0"})
        if code:
            print(f"the run under valgrind failed (exit {code}):\n{log.read_text()[-3000:]}", file=sys.stderr)
            return 1
        result = parse_dumps(Path(tmp), spec)
        differences = json.loads(Path(tmp, "differences.json").read_text())
    from benchmarks.overhead.report import machine

    print(f"Machine: {machine()}")
    print(f"valgrind {subprocess.run(['valgrind', '--version'], capture_output=True, text=True).stdout.strip()}, "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    print(f"ignite-mgpu's overrides: {' '.join(args.set) or 'none (the defaults)'}\n")
    print("\n".join(report(result, plan, args.nproc, differences)))
    if args.quick:
        print("\n(--quick: tiny windows; the counts are not meaningful, only that it runs)")
    if args.json:
        summary = {"plan": plan, "nproc": args.nproc, "per_iteration": result, "differences": differences}
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if any(differences.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
