"""CPU binding and loader workers, side by side in one run, interleaved (each round runs every variant once, in a
rotating order):

- the default job, ``ignite-mgpu train --nproc 2``, with ``--cpu-binding auto`` and ``none``, against the same job
  written as the PyTorch DDP tutorial writes it (tutorial.py): samples/s and final accuracy;
- the tiny MLP and the small CNN per iteration: hand-written, ignite's bare Engine and ignite-mgpu taking turns in
  one session (overhead/bench_overhead.py's sessions), unpinned, with ignite-mgpu's ``cores`` binding, and with
  bench_overhead.py's own pinning of the training thread;
- a JPEG image-folder job (files generated here, decoded by PIL, ResNet-18 at 64 px): samples/s and
  ``data_wait_share`` with ``data.num_workers`` 0, auto and one worker per process.

Run: python benchmarks/binding/bench_binding.py [--rounds 3] [--quick] [--only job,overhead,jpeg] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The helpers import as benchmarks.<folder>.<module> from the repository root (the sessions re-run
# overhead/bench_overhead.py, which does the same).
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.binding.runs import make_jpegs, overhead_session, same_weights, shuffled, train_job, tutorial_job
from benchmarks.overhead.loops import REFERENCE, WORKLOADS
from benchmarks.overhead.report import (
    bootstrap,
    extra_cpu_over,
    interval_cell,
    machine,
    per_round_ms,
    ratio_over,
    spread,
    verdict,
)

PER_ITERATION_TARGET = 1.01  # ignite-mgpu over ignite's bare Engine, tiny MLP and small CNN, 2 processes
SPEEDUP_TARGET = 1.3  # the default job as shipped over the tutorial loop, samples/s
ACCURACY_TOLERANCE = 0.01  # "the same final accuracy": within one point of the tutorial loop's
LOOPS = ("hand-written", REFERENCE, "ignite-mgpu")


def shipped_default() -> str:
    from ignite_mgpu.config.schema import DistConfig

    return DistConfig().cpu_binding


def thread_counts() -> dict[str, list[int]]:
    """Intra-op threads of each process of ``ignite-mgpu train --nproc 2`` with auto and with none, as the launcher
    plans them on this machine (none: OMP_NUM_THREADS = online CPUs // processes)."""
    from benchmarks.binding.runs import job_env
    from ignite_mgpu.cpus.binding import plan_for_job

    none = max(1, (os.cpu_count() or 1) // 2)
    auto = [r.threads or none for r in plan_for_job("auto", 2, None, False, "ddp", job_env()).ranks]
    return {"auto": auto, "none": [none, none]}


def paired(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """mean(num) / mean(den) over the rounds, with a 95 % interval resampling the rounds (run back to back)."""
    return sum(num) / sum(den), *bootstrap(num, den)


def not_slower(low: float, high: float) -> str:
    """``auto`` against ``none``: slower beyond noise only when the whole interval lies below 1."""
    return "**no**" if high < 1.0 else "yes"


def job_part(tmp: Path, rounds: int, variants: list[str], quick: bool) -> tuple[list[str], dict]:
    epochs, train_size = (1, 512) if quick else (2, 4096)
    extra = [f"data.train_size={train_size}", f"train.epochs={epochs}"] if quick else []
    runs: dict[str, list[dict]] = {"auto": [], "none": [], "tutorial": []}
    for r in range(rounds):
        for name in shuffled(list(runs), r):
            if name == "tutorial":
                runs[name].append(tutorial_job(tmp / f"job-{r}-tutorial.json", 2, epochs, train_size))
            else:
                runs[name].append(train_job(tmp / f"job-{r}-{name}", ["--nproc", "2", "--cpu-binding", name, *extra]))
    threads = thread_counts()
    compared = [same_weights(a["weights"], b["weights"]) for a, b in zip(runs["auto"], runs["none"], strict=True)]
    differ = [d for d in compared if d]
    tutorial = [run["samples_per_s"] for run in runs["tutorial"]]
    tutorial_acc = statistics.median(run["val_accuracy"] for run in runs["tutorial"])
    lines = [
        "| default job, 2 procs | samples/s, median of rounds (min–max) | over the tutorial loop [95 %] | "
        "final val accuracy, median | target | met |",
        "|---|---|---|---|---|---|",
    ]
    identical = f"{rounds - len(differ)}/{rounds}" if threads["auto"] == threads["none"] else "not compared"
    summary: dict = {"runs": runs, "threads": threads, "auto_vs_none_identical": identical}
    for name in ("auto", "none"):
        mine = [run["samples_per_s"] for run in runs[name]]
        ratio, low, high = paired(mine, tutorial)
        acc = statistics.median(run["val_accuracy"] for run in runs[name])
        label = f"ignite-mgpu --cpu-binding {name}" + (" (the default as shipped)" if name == shipped_default() else "")
        target, met = "", ""
        if name == shipped_default():
            same_accuracy = abs(acc - tutorial_acc) <= ACCURACY_TOLERANCE
            target = f"≥ {SPEEDUP_TARGET}× at ±{ACCURACY_TOLERANCE:.2f} accuracy"
            met = verdict(low, high, SPEEDUP_TARGET, float("inf")) if same_accuracy else "**no**: accuracy differs"
        summary[name] = {"ratio_over_tutorial": [ratio, low, high], "accuracy": acc, "met": met}
        lines.append(
            f"| {label} | {spread(mine, 1)} | {interval_cell(ratio, low, high)} | {acc:.4f} | {target} | {met} |"
        )
    label = f"DDP tutorial loop ({runs['tutorial'][0]['threads']} threads per process)"
    lines.append(f"| {label} | {spread(tutorial, 1)} | | {tutorial_acc:.4f} | | |")
    ratio, low, high = paired([r["samples_per_s"] for r in runs["auto"]], [r["samples_per_s"] for r in runs["none"]])
    summary["auto_over_none"] = [ratio, low, high]
    lines.append(f"| auto / none | | {interval_cell(ratio, low, high)} | | not slower | {not_slower(low, high)} |")
    if identical == "not compared":
        weights = f"not compared: the thread counts differ (auto {threads['auto']}, none {threads['none']})."
    else:
        weights = f"bit-identical in {identical} rounds" + (f" (first difference: {differ[0]})." if differ else ".")
    lines.append(
        f"\nBinding lines: auto: {runs['auto'][0]['binding'] or '-'}; none: {runs['none'][0]['binding'] or '-'}. "
        f"Intra-op threads per process: auto {threads['auto']}, none {threads['none']}. Final weights auto vs "
        f"none: {weights}"
    )
    return lines, summary


def overhead_part(tmp: Path, rounds: int, variants: list[str], quick: bool) -> tuple[list[str], dict]:
    iters = {w: spec[3 if quick else 2] for w, spec in WORKLOADS.items()}
    epochs = 1 if quick else 3
    sessions: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in shuffled(variants, r):
            sessions[v].append(overhead_session(tmp / f"overhead-{r}-{v}", v, iters, epochs))
    lines = [
        "| workload | binding | loop | ms / iteration, median of rounds (min–max) | over unpinned, per round [95 %] |",
        "|---|---|---|---|---|",
    ]
    engine_lines = [
        "",
        "| workload | binding | ignite-mgpu / ignite's bare Engine, all turns [95 %] | target | met | extra CPU µs / "
        "iteration of rank 0's training thread, all turns [95 %] |",
        "|---|---|---|---|---|---|",
    ]
    summary: dict = {"identical": {}, "over_engine": {}, "extra_cpu_us": {}}
    for w in WORKLOADS:
        runs = {v: [run for s in sessions[v] for run in s["runs"] if run["workload"] == w] for v in variants}
        bad = [run["difference"] for v in variants for run in runs[v] if run["difference"]]
        for r in range(rounds):  # (b)'s final weights against the unpinned session's of the same round
            final = {
                v: str(next((tmp / f"overhead-{r}-{v}/session-2/{w}-0").glob("checkpoint_*.pt"))) for v in variants
            }
            bad += [d for v in variants if (d := same_weights(final["none"], final[v]))]
        summary["identical"][w] = not bad
        for name in LOOPS:
            base = per_round_ms(runs["none"], name)
            for v in variants:
                ms = per_round_ms(runs[v], name)
                cell = "" if v == "none" else interval_cell(*paired(ms, base))
                lines.append(f"| {WORKLOADS[w][0]} | {v} | {name} | {spread(ms)} | {cell} |")
        for v in variants:
            if bad:
                engine_lines.append(f"| {WORKLOADS[w][0]} | {v} | refused: weights differ ({bad[0]}) | | | |")
                continue
            ratio, low, high = ratio_over(runs[v], "ignite-mgpu", REFERENCE)
            met = verdict(low, high, 0.0, PER_ITERATION_TARGET)
            # The CPU clock leaves out waiting (for the other rank, for a core): the work ignite-mgpu itself adds.
            extra = extra_cpu_over(runs[v], "ignite-mgpu", REFERENCE)
            summary["over_engine"][f"{w}/{v}"] = [ratio, low, high, met]
            summary["extra_cpu_us"][f"{w}/{v}"] = [1e6 * e for e in extra]
            cells = f"{interval_cell(ratio, low, high)} | ≤ {PER_ITERATION_TARGET} | {met} | "
            cells += interval_cell(*extra, scale=1e6, digits=1)
            engine_lines.append(f"| {WORKLOADS[w][0]} | {v} | {cells} |")
    same = ", ".join(f"{WORKLOADS[w][0]}: {'yes' if ok else '**no**'}" for w, ok in summary["identical"].items())
    tail = [f"\nFinal weights bit-identical over every loop and binding (1 thread each): {same}."]
    summary["sessions"] = sessions
    return lines + engine_lines + tail, summary


def jpeg_part(tmp: Path, rounds: int, variants: list[str], quick: bool) -> tuple[list[str], dict]:
    train, val, epochs, batch, size = (64, 16, 1, 32, 32) if quick else (2560, 500, 2, 128, 64)
    model = "simple_cnn" if quick else "resnet18"  # --quick checks the part, it does not measure it
    root = make_jpegs(tmp / "jpegs", train, val)
    common = ["--nproc", "2", "--cpu-binding", "auto", "data.name=imagefolder", f"data.root={root}"]
    common += [f"model.name={model}", f"data.image_size={size}", f"data.batch_size={batch}", f"train.epochs={epochs}"]
    common += ["checkpoint.every=0"]
    variants = {"0": "0", "auto": "auto"} | ({} if quick else {"1 per process": "2"})
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in shuffled(list(variants), r):
            out = tmp / f"jpeg-{r}-{list(variants).index(v)}"
            runs[v].append(train_job(out, [*common, f"data.num_workers={variants[v]}"]))
    lines = [
        f"| JPEG folder ({train} files, {model} at {size} px), 2 procs | samples/s, median (min–max) | over 0 "
        "[95 %] | data_wait_share, last epoch, median | loader workers per process |",
        "|---|---|---|---|---|",
    ]
    base = [run["samples_per_s"] for run in runs["0"]]
    for v in variants:
        mine = [run["samples_per_s"] for run in runs[v]]
        cell = "" if v == "0" else interval_cell(*paired(mine, base))
        wait = statistics.median(run["data_wait_share"] for run in runs[v])
        chosen = runs[v][0]["auto_workers"] if v == "auto" else (0 if v == "0" else 1)
        lines.append(f"| data.num_workers={v} | {spread(mine, 1)} | {cell} | {wait:.3f} | {chosen} |")
    return lines, {"runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every variant once [3]")
    parser.add_argument(
        "--quick", action="store_true", help="one short round of everything, two parts at a time: checks, not timings"
    )
    parser.add_argument("--only", default="job,overhead,jpeg", help="parts to run [job,overhead,jpeg]")
    parser.add_argument("--variants", default="none,cores,pinned", help="overhead bindings [none,cores,pinned]")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    variants = ["none", "cores"] if args.quick else args.variants.split(",")
    parts = args.only.split(",")
    load_before = open("/proc/loadavg").read().split()[:3]
    started = time.perf_counter()
    output: list[str] = []
    summary: dict = {"machine": machine(), "rounds": rounds, "quick": args.quick}
    todo = {"job": job_part, "overhead": overhead_part, "jpeg": jpeg_part}
    todo = {part: run for part, run in todo.items() if part in parts}

    def timed(part: str, tmp: Path) -> tuple[float, tuple[list[str], dict]]:
        began = time.perf_counter()
        result = todo[part](tmp, rounds, variants, args.quick)
        return time.perf_counter() - began, result

    # --quick checks, it does not measure: its parts (their jobs mostly start-up) run two at a time, the two longest
    # first; a measuring run takes one part after the other.
    order = sorted(todo, key=["job", "jpeg", "overhead"].index) if args.quick else list(todo)
    with tempfile.TemporaryDirectory(prefix="bench-binding-") as name:
        with ThreadPoolExecutor(2 if args.quick else 1) as pool:
            done = dict(zip(order, pool.map(lambda part: timed(part, Path(name)), order), strict=True))
    for part in todo:
        seconds, (lines, summary[part]) = done[part]
        output += ["", f"{part}: {seconds:.0f} s", *lines]
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"Machine: {machine()}")
    print(
        f"Load average (1/5/15 min) before {'/'.join(load_before)}, after {'/'.join(load_after)}; {rounds} round(s), "
        f"{time.perf_counter() - started:.0f} s; default --cpu-binding as shipped: {shipped_default()}"
    )
    print("\n".join(output))
    if args.quick:
        print("\n(--quick: one short round; the timings are not meaningful, only the checks are)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    overhead_ok = all(summary.get("overhead", {}).get("identical", {}).values())
    job_ok = summary.get("job", {}).get("auto_vs_none_identical", "-") in ("-", "not compared", f"{rounds}/{rounds}")
    return 0 if overhead_ok and job_ok else 1  # binding changed the results: a bug, whatever the timings say


if __name__ == "__main__":
    sys.exit(main())
