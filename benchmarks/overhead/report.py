"""The report: statistics over the timed turns (bootstrap intervals, ratios, verdicts) and the markdown tables and
JSON summary that bench_overhead.py prints and writes."""

from __future__ import annotations

import os
import platform
import random
import statistics
from importlib import metadata
from typing import Any

from benchmarks.overhead.loops import LOOPS, REFERENCE, WORKLOADS

BOOTSTRAP = 2000  # resamples for each 95 % interval
# Per iteration: ignite-mgpu over ignite's bare Engine running the same step, on 2 processes (the per-iteration
# criterion); the hand-written loop stays in the tables as the reference.
TARGETS = {"mlp": 1.01, "cnn": 1.01, "scaling": 0.02, "startup": 1.15, "help_s": 0.3, "calls": 100}


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    cores = len(os.sched_getaffinity(0))
    return (
        f"{cpu}, {cores} cores usable ({os.cpu_count()} online), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {metadata.version('torch')}, "
        f"pytorch-ignite {metadata.version('pytorch-ignite')}, ignite-mgpu {metadata.version('ignite-mgpu')}"
    )


def spread(values: list[float], digits: int = 3) -> str:
    """median (min–max)"""
    med = statistics.median(values)
    return (
        f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"
        if len(values) > 1
        else f"{med:.{digits}f}"
    )


def bootstrap(num: list[float], den: list[float], seed: int = 0) -> tuple[float, float]:
    """95 % interval of sum(num) / sum(den), resampling the index (turn k of (b) and of (a) ran back to back)."""
    rng, n = random.Random(seed), len(num)
    found = []
    for _ in range(BOOTSTRAP):
        picks = [rng.randrange(n) for _ in range(n)]
        found.append(sum(num[i] for i in picks) / sum(den[i] for i in picks))
    found.sort()
    return found[int(0.025 * BOOTSTRAP)], found[int(0.975 * BOOTSTRAP) - 1]


def yes_no(ok: bool) -> str:
    return "yes" if ok else "**no**"


def verdict(low: float, high: float, lowest: float, highest: float) -> str:
    """Met when the whole interval lies within [lowest, highest], missed when none of it does."""
    if lowest <= low and high <= highest:
        return "yes"
    if high < lowest or low > highest:
        return "**no**"
    return "undecided: the interval spans the target"


def turn_times(runs: list[dict], name: str, clock: int) -> list[float]:
    """Seconds per iteration of every timed turn of ``name`` in these rounds, in order (clock 0 wall, 1 CPU)."""
    return [turn[clock] / run["window"] for run in runs for turn in run["turns"][name]]


def per_round_ms(runs: list[dict], name: str, clock: int = 0) -> list[float]:
    """ms per iteration of each round (all its timed turns), by the wall (0) or CPU (1) clock."""
    return [1000 * statistics.fmean(turn_times([run], name, clock)) for run in runs]


def ratio_over(runs: list[dict], name: str, base: str) -> tuple[float, float, float]:
    """Wall time of all of ``name``'s turns over ``base``'s, with its paired 95 % bootstrap interval."""
    num, den = turn_times(runs, name, 0), turn_times(runs, base, 0)
    return sum(num) / sum(den), *bootstrap(num, den)


def extra_cpu_over(runs: list[dict], name: str, base: str) -> tuple[float, float, float]:
    """Mean extra CPU seconds per iteration of ``name`` over ``base``, turn by turn, with its 95 % interval."""
    extra = [b - a for a, b in zip(turn_times(runs, base, 1), turn_times(runs, name, 1), strict=True)]
    return statistics.fmean(extra), *bootstrap(extra, [1.0] * len(extra))


def interval_cell(value: float, low: float, high: float, scale: float = 1.0, digits: int = 3) -> str:
    return f"{scale * value:.{digits}f} [{scale * low:.{digits}f}–{scale * high:.{digits}f}]"


TIME_TABLE = [
    "| workload | procs | loop | ms / iteration, median of rounds (min–max) | ratio over hand-written, all turns "
    "[95 % interval] | median of rounds (min–max) |",
    "|---|---|---|---|---|---|",
]
CPU_TABLE = [
    "",
    "| workload | procs | loop | CPU ms / iteration of rank 0's training thread, median of rounds (min–max) | "
    "extra CPU µs / iteration over hand-written, all turns [95 % interval] |",
    "|---|---|---|---|---|",
]
OVER_REFERENCE_TABLE = [
    "",
    "| workload | procs | ignite-mgpu / ignite's bare Engine, all turns [95 % interval] | "
    "extra CPU µs / iteration over it, rank 0 [95 % interval] | target | met |",
    "|---|---|---|---|---|---|",
]
MEASUREMENT_TABLE = [
    "",
    "| measurement | hand-written | ignite-mgpu | comparison | target | met |",
    "|---|---|---|---|---|---|",
]


def report(sessions: dict[int, dict], startup: dict | None, help_s: list[float], quick: bool) -> tuple[str, dict]:
    """The markdown tables and a JSON summary. Ratios only for workloads whose weights matched bit for bit."""
    lines, cpu_lines, over_lines = list(TIME_TABLE), list(CPU_TABLE), list(OVER_REFERENCE_TABLE)
    summary: dict[str, Any] = {"per_iteration": {}, "refused": []}
    for nproc, res in sorted(sessions.items(), reverse=True):
        for workload in dict.fromkeys(run["workload"] for run in res["runs"]):
            runs = [run for run in res["runs"] if run["workload"] == workload]
            entry, time_rows, cpu_rows = loop_rows(runs, workload, nproc, summary["refused"])
            summary["per_iteration"][f"{workload}/{nproc}"] = entry
            lines += time_rows
            cpu_lines += cpu_rows
            over_lines += over_reference_rows(runs, workload, nproc, entry)
    lines += cpu_lines + over_lines + MEASUREMENT_TABLE
    lines += scaling_rows(sessions, summary)
    lines += startup_rows(startup, summary)
    lines += help_rows(help_s, summary)
    lines += calls_rows(sessions.get(2, {}).get("calls", {}), summary)
    if quick:
        lines += ["", "(--quick: one short round; the timings are not meaningful, only the checks are)"]
    return "\n".join(lines), summary


def loop_rows(runs: list[dict], workload: str, nproc: int, refused: list[str]) -> tuple[dict, list[str], list[str]]:
    """One workload on ``nproc`` processes: its JSON entry and its rows of the time and the CPU table, one per loop.
    A weight mismatch withholds every ratio and is appended to ``refused``."""
    bad = [run["difference"] for run in runs if run["difference"]]
    title = WORKLOADS[workload][0]
    names = [name for name in (*LOOPS, REFERENCE) if name in runs[0]["turns"]]
    entry: dict[str, Any] = {"identical": f"{len(runs) - len(bad)}/{len(runs)}", "loops": {}}
    time_rows, cpu_rows = [], []
    for name in names:
        ms, cpu_ms = per_round_ms(runs, name), per_round_ms(runs, name, clock=1)
        entry["loops"][name] = {"ms_per_round": ms, "cpu_ms_per_round": cpu_ms}
        label = name if name != REFERENCE else f"{REFERENCE} (reference)"
        cells = ["", ""]
        cpu_cell = ""
        if name != "hand-written" and bad:
            cells[0] = f"refused: final weights differ in {len(bad)}/{len(runs)} runs ({bad[0]})"
            if name == "ignite-mgpu":
                refused.append(f"{title}, {nproc} procs: {bad[0]}")
                entry["met"] = False
        elif name != "hand-written":
            ratio, low, high = ratio_over(runs, name, "hand-written")
            rounds = [b / a for a, b in zip(per_round_ms(runs, "hand-written"), ms, strict=True)]
            cells[0], cells[1] = interval_cell(ratio, low, high), spread(rounds)
            cpu_cell = interval_cell(*extra_cpu_over(runs, name, "hand-written"), scale=1e6, digits=0)
            entry["loops"][name] |= {"ratio": ratio, "interval": [low, high], "ratio_per_round": rounds}
        time_rows.append(f"| {title} | {nproc} | {label} | {spread(ms)} | {' | '.join(cells)} |")
        cpu_rows.append(f"| {title} | {nproc} | {label} | {spread(cpu_ms)} | {cpu_cell} |")
    return entry, time_rows, cpu_rows


def over_reference_rows(runs: list[dict], workload: str, nproc: int, entry: dict[str, Any]) -> list[str]:
    """What ignite-mgpu's step and handlers add to ignite's own loop, against the per-iteration target (2 processes):
    none when the reference did not run or the weights differ; else one row, also stored in ``entry``."""
    if REFERENCE not in runs[0]["turns"] or any(run["difference"] for run in runs):
        return []
    ratio, low, high = ratio_over(runs, "ignite-mgpu", REFERENCE)
    extra = extra_cpu_over(runs, "ignite-mgpu", REFERENCE)
    entry["over_reference"] = {"ratio": ratio, "interval": [low, high], "extra_cpu_s": extra[0]}
    target, met = "", ""
    if nproc == 2:
        entry["met"] = met = verdict(low, high, 0.0, TARGETS[workload])
        target = f"≤ {TARGETS[workload]}"
    return [
        f"| {WORKLOADS[workload][0]} | {nproc} | {interval_cell(ratio, low, high)} | "
        f"{interval_cell(*extra, scale=1e6, digits=0)} | {target} | {met} |"
    ]


def scaling_rows(sessions: dict[int, dict], summary: dict[str, Any]) -> list[str]:
    """The small CNN's throughput, 2 procs over 1 proc, for each loop, and ignite-mgpu's scaling over (a)'s."""
    per = summary["per_iteration"]
    if not ("cnn/1" in per and "cnn/2" in per and not summary["refused"]):
        why = "refused: final weights differ" if summary["refused"] else "skipped (--quick)"
        return [f"| small CNN throughput, 2 procs / 1 proc | {why} | | | | |"]
    # The global batch is the same with 1 and 2 processes, so the throughput ratio is t(1 proc) / t(2 procs).
    cnn = {n: [run for run in sessions[n]["runs"] if run["workload"] == "cnn"] for n in (1, 2)}
    t = {(n, name): turn_times(cnn[n], name, 0) for n in (1, 2) for name in LOOPS}
    scale = {name: statistics.fmean(t[1, name]) / statistics.fmean(t[2, name]) for name in LOOPS}
    # ignite-mgpu's scaling over the hand-written loop's = ((b)/(a) at 1 proc) / ((b)/(a) at 2 procs), from the
    # turns of each session: only the turns of one run share the machine's state.
    rel = per["cnn/1"]["loops"]["ignite-mgpu"]["ratio"] / per["cnn/2"]["loops"]["ignite-mgpu"]["ratio"]
    (low1, high1), (low2, high2) = (
        per["cnn/1"]["loops"]["ignite-mgpu"]["interval"],
        per["cnn/2"]["loops"]["ignite-mgpu"]["interval"],
    )
    low, high = low1 / high2, high1 / low2  # conservative: both intervals at their ends
    met = verdict(low, high, 1 - TARGETS["scaling"], 1 + TARGETS["scaling"])
    summary["scaling"] = scale | {"relative": rel, "interval": [low, high], "met": met}
    return [
        f"| small CNN throughput, 2 procs / 1 proc | {scale['hand-written']:.3f}× | {scale['ignite-mgpu']:.3f}× "
        f"| {interval_cell(rel, low, high)} | within ±{TARGETS['scaling']:.0%} | {met} |"
    ]


def startup_rows(startup: dict | None, summary: dict[str, Any]) -> list[str]:
    """Launch to the first finished iteration (wall), and the CPU seconds of the whole command."""
    if not startup:
        return ["| launch → first finished iteration, 2 procs (s) | skipped (--quick) | | | | |"]
    wall, cpu = startup["wall"], startup["cpu"]
    rel = statistics.median(wall["ignite-mgpu"]) / statistics.median(wall["hand-written"])
    ok = rel <= TARGETS["startup"]
    summary["startup"] = startup | {"relative": rel, "met": ok}
    rel_cpu = statistics.median(cpu["ignite-mgpu"]) / statistics.median(cpu["hand-written"])
    return [
        f"| launch → first finished iteration, 2 procs (s) | {spread(wall['hand-written'], 2)} | "
        f"{spread(wall['ignite-mgpu'], 2)} | {rel:.2f}× | ≤ {TARGETS['startup']}× | {yes_no(ok)} |",
        f"| CPU seconds of that whole command, all processes | {spread(cpu['hand-written'], 2)} | "
        f"{spread(cpu['ignite-mgpu'], 2)} | {rel_cpu:.2f}× | — | — |",
    ]


def help_rows(help_s: list[float], summary: dict[str, Any]) -> list[str]:
    ok = statistics.median(help_s) < TARGETS["help_s"]
    summary["help_s"] = {"values": help_s, "met": ok}
    return [f"| `ignite-mgpu --help` (s) | | {spread(help_s, 3)} | | < {TARGETS['help_s']} s | {yes_no(ok)} |"]


def calls_rows(calls: dict[str, dict], summary: dict[str, Any]) -> list[str]:
    """Python calls per iteration of rank 0 (2 procs), for each profiled workload."""
    rows = []
    for workload, c in calls.items():
        ok = c["extra"] <= TARGETS["calls"]
        rows.append(
            f"| Python calls / iteration, rank 0, {WORKLOADS[workload][0]} (cProfile) | {c['hand-written']:.1f} "
            f"| {c['ignite-mgpu']:.1f} | +{c['extra']:.1f} | ≤ +{TARGETS['calls']} | {yes_no(ok)} |"
        )
    summary["calls"] = calls
    return rows
