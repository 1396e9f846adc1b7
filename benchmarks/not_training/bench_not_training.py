"""The time a job spends not training (issue #30), every headline ratio in one run: a killed rank to the restarted
group's first iteration, launch to the first iteration against the hand-written ``mp.spawn`` launch (2 and 4
processes), the checkpoint stall per save with ``checkpoint.async_save`` against the synchronous save (full files
and sharded folders), the FSDP step against a hand-written FSDP2 loop and evaluation per batch against a
hand-written loop.

It runs the benchmarks that measure each one (``restart/``, ``overhead/bench_startup.py``, ``checkpoint/``,
``fsdp/bench_fsdp_step.py``) one after the other, prints their own output as it comes, then one table of the
figures against their targets; ``--write`` also saves all of it as ``benchmarks/results/not_training_<date>.md``.
Figures are ratios within each benchmark's own interleaved turns, so the machine's load mostly cancels out; the
seconds do not carry over to another machine.
Run: `python benchmarks/not_training/bench_not_training.py [--quick] [--only restart,launch,stall,fsdp] [--write]`
(about 45 minutes on 2 quiet cores; ``--quick``: a few minutes, the checks and rough figures only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PARTS = ("restart", "launch", "stall", "fsdp")
# bench_fsdp_step.py's defaults (5 rounds, 40 passes) left intervals of +-2-4 % on a quiet machine, too wide to
# decide a 1.02 target; 12 rounds gave +-1 % for the step, 400 passes +-0.6 % for the CNN's evaluation, and the
# tiny GPT-2's evaluation (its FSDP collectives make single batches vary most) took 1500 passes, +-0.7 %, about 15
# minutes (benchmarks/results/not_training_2026-12-02.md): two runs of the script.
LONG_FSDP = [
    ["--rounds", "12", "--passes", "400", "--eval-workloads", "cnn"],
    ["--only", "eval", "--eval-workloads", "gpt2", "--passes", "1500"],
]


class Row(NamedTuple):
    what: str
    value: float | None  # None: the benchmark gave no figure (it failed, or a check withheld the ratio)
    target: str  # "≤ 1.5" or "< 1.0"
    unit: str  # "s" or "x"
    verdict: str | None = None  # the benchmark's own (from its interval); None: the value against the target


def run(name: str, argv: list[str], log: list[str]) -> str:
    """One benchmark script's output (stdout), echoed as it comes and kept for the report."""
    print(f"\n## {name}: python {' '.join(argv)}", flush=True)
    proc = subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    code = proc.wait()
    out = "".join(lines)
    log += [f"## {name}", "", f"`python {' '.join(argv)}` (exit {code})", "", "```", out.rstrip(), "```", ""]
    return out if code == 0 else ""


def found(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def restart(quick: bool, log: list[str]) -> list[Row]:
    out = run(
        "restart", ["benchmarks/restart/bench_restart.py", "--restart-only", "--repeat", "1" if quick else "3"], log
    )
    seconds = found(r"first iteration of the restarted group: median ([\d.]+) s", out)
    return [Row("a killed rank to the restarted group's first iteration, s", seconds, "≤ 1.5", "s")]


def launch(quick: bool, log: list[str]) -> list[Row]:
    argv = ["benchmarks/overhead/bench_startup.py", "--rounds", "1" if quick else "3", "--nproc", "2", "4"]
    out = run("launch", [*argv, "--workloads", "cnn", "--no-cli"], log)
    rows = []
    for nproc, target in ((2, "≤ 0.9"), (4, "< 1.0")):
        table = out.split(f"cnn, {nproc} processes:", 1)[-1]
        ratio = found(r"\n\s+ignite-mgpu train\s.*?([\d.]+)x / [\d.]+x", table)
        what = f"launch to the first step, small CNN, {nproc} processes, over hand-written mp.spawn"
        rows.append(Row(what, ratio, target, "x"))
    return rows


def stall(quick: bool, log: list[str]) -> list[Row]:
    argv = ["benchmarks/checkpoint/bench_checkpoint_stall.py", *(["--quick"] if quick else [])]
    out = run("checkpoint stall", argv, log)
    what = "small model" if quick else "170M parameters, AdamW"
    return [
        Row(
            f"checkpoint stall per save, async over sync, {name} ({what})",
            found(rf"{name}: async / sync stall ratio ([\d.]+)", out),
            "≤ 0.2",
            "x",
        )
        for name in ("full", "sharded")
    ]


def fsdp(quick: bool, log: list[str]) -> list[Row]:
    summary: dict = {"eval": {}}
    with tempfile.TemporaryDirectory(prefix="bench-not-training-") as tmp:
        for i, args in enumerate([["--quick"]] if quick else LONG_FSDP):
            path = Path(tmp, f"fsdp{i}.json")
            run("FSDP step and evaluation", ["benchmarks/fsdp/bench_fsdp_step.py", *args, "--json", str(path)], log)
            found = json.loads(path.read_text()) if path.is_file() else {}
            summary["eval"] |= found.get("eval", {})  # each workload's evaluation from one of the runs
            summary.setdefault("step", found.get("step"))
    step = summary.get("step") or {}
    rows = [
        Row("FSDP step over a hand-written FSDP2 loop (tiny GPT-2)", step.get("ratio"), "≤ 1.02", "x", step.get("met"))
    ]
    for workload, entry in summary.get("eval", {}).items():
        what = f"evaluation per batch over a hand-written loop ({workload})"
        rows.append(Row(what, entry.get("ratio"), "≤ 1.02", "x", entry.get("met")))
    return rows


def met(value: float | None, target: str) -> str:
    if value is None:
        return "no figure (see its output)"
    op, bound = target.split()
    return "met" if (value <= float(bound) if op == "≤" else value < float(bound)) else "missed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round of each: checks and rough figures")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--write", action="store_true", help="save the report in benchmarks/results/")
    opts = parser.parse_args()
    parts: dict[str, Callable[[bool, list[str]], list[Row]]] = {
        "restart": restart,
        "launch": launch,
        "stall": stall,
        "fsdp": fsdp,
    }
    load = os.getloadavg()[0]
    log: list[str] = []
    rows = [row for name in opts.only.split(",") for row in parts[name](opts.quick, log)]
    table = ["| figure | measured | target | verdict |", "|---|---|---|---|"]
    for what, value, target, unit, verdict in rows:
        shown = "—" if value is None else f"{value:.3f}{' s' if unit == 's' else '×'}"
        table.append(f"| {what} | {shown} | {target}{' s' if unit == 's' else '×'} | {verdict or met(value, target)} |")
    head = (
        f"{os.cpu_count()} CPUs, load average {load:.2f} before and {os.getloadavg()[0]:.2f} after"
        f"{', --quick' if opts.quick else ''}"
    )
    print("\n# Time not training\n\n" + head + "\n\n" + "\n".join(table))
    if opts.write:
        day = datetime.date.today().isoformat()
        path = BENCHMARKS / "results" / f"not_training_{day}{'_quick' if opts.quick else ''}.md"
        path.write_text("\n".join([f"# Time not training, {day}", "", head, "", *table, "", *log]) + "\n")
        print(f"\nwritten: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
