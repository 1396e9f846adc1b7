"""The worker sessions: one ``launch`` of gloo processes per process count, pinned to cores, in which the loops of
``loops`` take turns; and the Python calls per iteration, counted with cProfile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.overhead.loops import (
    LOOPS,
    REFERENCE,
    Turns,
    bitwise_difference,
    engine_steps,
    finish,
    hand_built,
    hand_steps,
    ignite_run,
    make_config,
)

ENTRY_SCRIPT = str(Path(__file__).with_name("bench_overhead.py"))  # re-run in a fresh interpreter for each session
PROFILE_ITERS = (20, 60)  # call counts are taken at two run lengths; the difference cancels set-up and teardown
# Each round is one run of (b), 1 warm-up epoch (allocations, DDP buckets) and then measured epochs, in which the
# loops take turns TURNS_PER_EPOCH times per epoch (about 0.15 s a turn with the default iterations).
MEASURED_EPOCHS = 3
TURNS_PER_EPOCH = 5


def count_calls(fn: Any, profile: bool) -> dict[str, int]:
    """Run ``fn()``; when ``profile``, return cProfile's call count of every function (file:line(name))."""
    if not profile:
        fn()
        return {}
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats.items()
    return {f"{Path(f).name}:{line}({name.split(' at 0x')[0]})": v[1] for (f, line, name), v in stats}  # type: ignore[attr-defined]  # pstats.Stats.stats is untyped


def calls_per_iteration(worker_dir: Path, workload: str, nproc: int, local_rank: int, rank: int) -> dict[str, Any]:
    """Python calls per iteration in rank 0, (a) and (b): (calls at n2 - calls at n1) / (n2 - n1)."""
    per_iter: dict[str, dict[str, float]] = {}
    n1, n2 = PROFILE_ITERS
    for name in LOOPS:
        counts = []
        for n in (n1, n2):
            cfg = make_config(workload, n, 1, worker_dir / f"calls-{workload}-{name}-{n}", nproc)  # 1 epoch
            if name == "hand-written":
                counts.append(count_calls(lambda c=cfg: finish(hand_steps(hand_built(c), 1, None)), rank == 0))
            else:
                counts.append(count_calls(lambda c=cfg: ignite_run(local_rank, c), profile=rank == 0))
        per_iter[name] = {k: (counts[1].get(k, 0) - counts[0].get(k, 0)) / (n2 - n1) for k in counts[1]}
    if rank != 0:
        return {}
    a, b = per_iter["hand-written"], per_iter["ignite-mgpu"]
    extra = {k: b.get(k, 0) - a.get(k, 0) for k in a.keys() | b.keys()}
    top = sorted(((v, k) for k, v in extra.items() if v > 0), reverse=True)[:15]
    return {
        "hand-written": sum(a.values()),
        "ignite-mgpu": sum(b.values()),
        "extra": sum(extra.values()),
        "top_extra": [[k, round(v, 2)] for v, k in top],
    }


def pin_to_core(rank: int, nproc: int) -> int | None:
    """Pin this process's main thread to a core of its own; None (unpinned) when there are fewer cores than ranks.

    Unpinned, the ranks migrate between the cores, which makes every loop's step slower and noisier alike. Only the
    calling thread is pinned: gloo's threads, started earlier, stay free to run on any core (pinned beside the main
    thread they slow the step down again). The measured figures: benchmarks/README.md.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < nproc:
        return None
    os.sched_setaffinity(0, {cores[rank]})  # Linux: pid 0 is the calling thread
    return cores[rank]


def window_size(iters: int) -> int:
    """Iterations per turn: the largest divisor of ``iters`` up to ``iters / TURNS_PER_EPOCH``, so that a turn never
    spans two epochs."""
    return max(d for d in range(1, max(1, iters // TURNS_PER_EPOCH) + 1) if iters % d == 0)


def session_worker(local_rank: int, spec: dict[str, Any]) -> None:
    """In every process: for each workload and round, one run of (b) with (a) (and the reference) taking turns in
    it; rank 0 records every turn's times and the bitwise comparison."""
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    core = pin_to_core(rank, spec["nproc"]) if spec["pin"] else None
    root = Path(spec["dir"])
    results: dict[str, Any] = {"runs": [], "calls": {}, "core": core}
    for workload in spec["workloads"]:
        iters = spec["iters"][workload]
        window = window_size(iters)
        for r in range(spec["rounds"]):
            cfg = make_config(workload, iters, 1 + spec["measured_epochs"], root / f"{workload}-{r}", spec["nproc"])
            epochs = cfg.train.epochs
            # Built before (b) starts: hand_built seeds the generator as training() does when it builds its model.
            others = {
                "hand-written": hand_steps(hand_built(cfg), epochs, window),
                REFERENCE: engine_steps(hand_built(cfg), epochs, window),
            }
            turns = Turns(others, window)
            state_b = ignite_run(local_rank, cfg, turns)
            states = {name: finish(steps) for name, steps in others.items()}
            gc.collect()  # outside the timed turns
            if rank == 0:
                assert state_b is not None
                difference = bitwise_difference(states["hand-written"], state_b)
                reference = bitwise_difference(states["hand-written"], states[REFERENCE])
                difference = difference or (reference and f"{REFERENCE}: {reference}")
                record = {"workload": workload, "round": r, "window": window, "difference": difference}
                results["runs"].append(record | {"turns": turns.turns})
        if workload in spec["profile"]:
            results["calls"][workload] = calls_per_iteration(root, workload, spec["nproc"], local_rank, rank)
    if rank == 0:
        (root / "results.json").write_text(json.dumps(results))


def run_session(
    tmp: Path,
    nproc: int,
    workloads: list[str],
    rounds: int,
    iters: dict,
    epochs: int,
    profile: list[str],
    pin: bool,
    cpu_binding: str = "none",
) -> dict:
    """One ``launch`` of ``nproc`` gloo processes in a fresh interpreter, with ignite-mgpu's ``cpu_binding``;
    returns rank 0's results."""
    spec = {
        "dir": str(tmp / f"session-{nproc}"),
        "nproc": nproc,
        "workloads": workloads,
        "rounds": rounds,
        "iters": iters,
        "measured_epochs": epochs,
        "profile": profile,
        "pin": pin,
        "cpu_binding": cpu_binding,
    }
    Path(spec["dir"]).mkdir(parents=True)
    log = Path(spec["dir"], "session.log")
    with log.open("w") as f:
        code = subprocess.call([sys.executable, ENTRY_SCRIPT, "--session", json.dumps(spec)], stdout=f, stderr=f)
    if code:
        sys.exit(
            f"benchmark session with {nproc} process(es) failed (exit {code}); its log:\n{log.read_text()[-4000:]}"
        )
    return json.loads(Path(spec["dir"], "results.json").read_text())


def session_main(spec_json: str) -> None:
    from ignite_mgpu import launch

    spec = json.loads(spec_json)
    launch(session_worker, spec, nproc=spec["nproc"], backend="gloo", cpu_binding=spec.get("cpu_binding", "none"))
