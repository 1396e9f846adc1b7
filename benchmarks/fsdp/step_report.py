"""bench_fsdp_step.py's report: per-iteration and per-batch ratios over the hand-written loops, with paired 95 %
bootstrap intervals over the turns (overhead/report.py's statistics), the spread of the rounds, and verdicts."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.fsdp import eval_loops, step_loops
from benchmarks.overhead.report import interval_cell, machine, per_round_ms, ratio_over, spread, verdict

TARGET = 1.02  # issue #30: FSDP step and evaluation per batch, over the hand-written loops


def step_rows(runs: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """The FSDP step: ms per iteration of each loop, ignite-mgpu over hand-written; refused on a weight mismatch."""
    title = step_loops.WORKLOADS["gpt2"][0]
    bad = [run["difference"] for run in runs if run["difference"]]
    lines = [
        "| workload | loop | ms / iteration, median of rounds (min–max) | CPU ms / iteration, rank 0 | "
        "ignite-mgpu / hand-written, all turns [95 % interval] | per round, median (min–max) | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    hand = per_round_ms(runs, "hand-written")
    lines.append(
        f"| {title} | hand-written FSDP2 | {spread(hand)} | {spread(per_round_ms(runs, 'hand-written', 1))} | | | | |"
    )
    ours = per_round_ms(runs, "ignite-mgpu")
    cells = f"refused: final weights differ in {len(bad)}/{len(runs)} runs ({bad[0] if bad else ''}) | | |"
    entry: dict[str, Any] = {"identical": f"{len(runs) - len(bad)}/{len(runs)}", "ms": {"hand": hand, "ours": ours}}
    if bad:
        summary["refused"].append(f"{title}: {bad[0]}")
    else:
        ratio, low, high = ratio_over(runs, "ignite-mgpu", "hand-written")
        rounds = [b / a for a, b in zip(hand, ours, strict=True)]
        met = verdict(low, high, 0.0, TARGET)
        cells = f"{interval_cell(ratio, low, high)} | {spread(rounds)} | ≤ {TARGET} | {met} |"
        entry |= {"ratio": ratio, "interval": [low, high], "per_round": rounds, "met": met}
    lines.append(
        f"| {title} | ignite-mgpu `--strategy fsdp` | {spread(ours)} | "
        f"{spread(per_round_ms(runs, 'ignite-mgpu', 1))} | {cells}"
    )
    summary["step"] = entry
    return lines


def eval_rows(evals: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """Evaluation per batch of each workload: ms per batch of each loop and the ratio, with ignite's bare Engine's
    over the hand-written loop beside it (what ignite's loop itself costs); refused when metrics differ."""
    lines = [
        "",
        "| workload | batches per process and pass | hand-written ms / batch, median (min–max) | "
        "ignite-mgpu ms / batch | CPU ms / batch, rank 0: hand-written, ignite-mgpu | "
        f"{eval_loops.REFERENCE} / hand-written [95 % interval] | "
        "ignite-mgpu / hand-written, all passes [95 % interval] | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, e in evals.items():
        title = eval_loops.WORKLOADS[workload][0]
        run = {"turns": e["turns"], "window": e["window"]}
        per = {name: [1000 * t[0] / e["window"] for t in e["turns"][name]] for name in e["turns"]}
        cpu = {name: [1000 * t[1] / e["window"] for t in e["turns"][name]] for name in e["turns"]}
        entry: dict[str, Any] = {"ms_per_batch": per, "cpu_ms_per_batch": cpu, "differences": e["differences"]}
        if e["differences"]:
            summary["refused"].append(f"evaluation, {title}: {e['differences'][0]}")
            cells = f"refused: metrics differ ({e['differences'][0]}) | | | |"
        else:
            ratio, low, high = ratio_over([run], "ignite-mgpu", "hand-written")
            met = verdict(low, high, 0.0, TARGET)
            reference = ""
            if eval_loops.REFERENCE in e["turns"]:
                engine = ratio_over([run], eval_loops.REFERENCE, "hand-written")
                reference = interval_cell(*engine)
                entry["engine_ratio"], entry["engine_interval"] = engine[0], list(engine[1:])
            cells = f"{reference} | {interval_cell(ratio, low, high)} | ≤ {TARGET} | {met} |"
            entry |= {"ratio": ratio, "interval": [low, high], "met": met}
        summary["eval"][workload] = entry
        lines.append(
            f"| {title} | {e['window']} | {spread(per['hand-written'])} | {spread(per['ignite-mgpu'])} | "
            f"{statistics.median(cpu['hand-written']):.3f}, {statistics.median(cpu['ignite-mgpu']):.3f} | {cells}"
        )
    return lines


def report(results: dict[str, Any], spec: dict[str, Any], load_before: list[str], seconds: float) -> tuple[str, dict]:
    summary: dict[str, Any] = {"refused": [], "eval": {}}
    load_after = open("/proc/loadavg").read().split()[:3]
    lines = [
        f"Machine: {machine()}",
        "Each process pinned to a core of its own" if results["core"] is not None else "Processes not pinned",
        f"Load average (1/5/15 min) before {'/'.join(load_before)}, after {'/'.join(load_after)}; step: "
        f"{spec['rounds']} round(s) of {spec['epochs']} measured epoch(s) of {spec['iters']} iterations; "
        f"evaluation: {spec['passes']} passes per loop; {seconds:.0f} s",
        "",
    ]
    if results["runs"]:
        lines += step_rows(results["runs"], summary)
    if results["eval"]:
        lines += eval_rows(results["eval"], summary)
    if summary["refused"]:
        lines += ["", "Check FAILED, no ratio for: " + "; ".join(summary["refused"])]
    else:
        checks = []
        if results["runs"]:
            checks.append(f"FSDP final weights bit-identical ({summary['step']['identical']} runs)")
        if results["eval"]:
            passes = statistics.fmean(len(e["turns"]["hand-written"]) for e in results["eval"].values())
            checks.append(f"evaluation metrics equal in every pass ({passes:.0f} timed passes per loop)")
        lines += ["", "Checks passed: " + "; ".join(checks) + "."]
    if spec["passes"] <= 4:
        lines += ["", "(--quick: one short round and a few passes; the timings are not meaningful, only the checks)"]
    return "\n".join(lines), summary
