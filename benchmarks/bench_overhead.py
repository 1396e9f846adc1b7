"""What ignite-mgpu costs over a hand-written PyTorch DDP loop, on 2 gloo processes with one thread each.

Measures, with (a) a hand-written loop and (b) ``ignite_mgpu.train.training`` as ``ignite-mgpu train`` runs it:
time per iteration on a tiny MLP and on the default small CNN, 2-vs-1 process scaling, launch to the first
finished iteration, ``ignite-mgpu --help``, and the extra Python calls per iteration (cProfile, rank 0).
(a) and (b) alternate (a b, b a, ...) inside the same worker processes; a ratio is printed only when their final
weights are bit-identical, which proves that both did the same work.

Run: python benchmarks/bench_overhead.py [--rounds 5] [--iters N] [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

# Set before torch is imported in this process or any process it starts: one thread per process.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

WORKLOADS = {  # name -> title, global batch, iterations per measured epoch (default, --quick), config overrides
    "mlp": ("tiny MLP", 32, 500, 30, ["model.name=mlp", "data.image_size=8", "data.batch_size=32"]),
    "cnn": ("small CNN", 128, 40, 6, ["model.name=simple_cnn"]),
}
TARGETS = {"mlp": 1.03, "cnn": 1.01, "scaling": 0.02, "startup": 1.15, "help_s": 0.3, "calls": 100}
PROFILE_ITERS = (20, 60)  # call counts are taken at two run lengths; the difference cancels set-up and teardown
# Each run trains 1 warm-up epoch (allocations, DDP buckets) and then measured epochs; a run's figure is its
# fastest measured epoch, because other processes on the machine only ever add time.
MEASURED_EPOCHS = 3
LOOPS = ("hand-written", "ignite-mgpu")
REFERENCE = "ignite Engine"  # (a)'s step in ignite's bare Engine, on the tiny MLP: what ignite's loop itself costs


def make_config(workload: str, iters: int, epochs: int, output_dir: str | Path, nproc: int) -> Any:
    """The run's Config, built like ``ignite-mgpu train`` builds it (defaults < overrides, then validated).

    One epoch is one full pass (train_size = iters * batch), so every epoch starts a fresh, re-shuffled
    sampler pass. The full checkpoint is written once, after the last epoch, outside the timed part: it holds
    the final weights compared with (a). Validation runs on 256 samples (also outside the timed part).
    """
    from ignite_mgpu.config import load_config

    _, batch, _, _, overrides = WORKLOADS[workload]
    return load_config(
        None,
        [
            *overrides,
            f"data.train_size={iters * batch}",
            "data.val_size=256",
            f"train.epochs={epochs}",
            "train.progress_bar=false",
            f"checkpoint.every={epochs}",
            "dist.backend=gloo",
            f"dist.nproc={nproc}",
            f"output_dir={output_dir}",
            "seed=0",
        ],
    )


# ------------------------------------------------------------------------------------ (a) the hand-written loop


def _hand_built(cfg: Any) -> tuple[Any, ...]:
    """What (a) and the bare-Engine reference build by hand: sampler, loader, model (DDP when distributed), its
    unwrapped module, optimizer, LR schedule, loss. Model, data, optimizer and schedule come from ignite_mgpu's
    factories, so every loop starts from the same objects as ``training(cfg)``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from ignite_mgpu.data import build_datasets
    from ignite_mgpu.engine import create_lr_scheduler, create_optimizer
    from ignite_mgpu.models import create_model

    distributed = dist.is_available() and dist.is_initialized()
    world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    torch.manual_seed(cfg.seed)  # the generator state training() has when it builds the model
    train_ds, _ = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
    sampler = DistributedSampler(train_ds, world_size, rank, shuffle=cfg.data.shuffle, seed=cfg.seed)
    loader = DataLoader(train_ds, batch_size=cfg.data.batch_size // world_size, sampler=sampler)
    net = create_model(cfg.model, train_ds[0][0].unsqueeze(0))
    model = DistributedDataParallel(net) if distributed else net
    o = cfg.optim
    optimizer = create_optimizer(model, o.name, o.lr, o.momentum, o.weight_decay)
    steps = len(loader)
    total, warmup = steps * cfg.train.epochs, round(steps * o.warmup_epochs)
    scheduler = create_lr_scheduler(optimizer, total, warmup, o.scheduler == "cosine")
    return sampler, loader, model, net, optimizer, scheduler, nn.CrossEntropyLoss()


def hand_written(cfg: Any) -> tuple[list[float], list[float], dict[str, Any]]:
    """(a): the job of ``training(cfg)`` written out by hand, without engine, handlers or validation.

    Returns (ms per iteration of each epoch, CPU ms of the same, final weights). Timed like ignite times an epoch:
    from before ``set_epoch`` to after the last scheduler step. The CPU figure is this thread's CPU time
    (``time.thread_time``): it leaves out time spent waiting for the other rank or descheduled.
    """
    sampler, loader, model, net, optimizer, scheduler, loss_fn = _hand_built(cfg)
    ms_per_iter, cpu_ms_per_iter = [], []
    for epoch in range(cfg.train.epochs):
        start, cpu_start = time.perf_counter(), time.thread_time()
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        model.train()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            scheduler.step()
        ms_per_iter.append(1000 * (time.perf_counter() - start) / len(loader))
        cpu_ms_per_iter.append(1000 * (time.thread_time() - cpu_start) / len(loader))
    return ms_per_iter, cpu_ms_per_iter, {k: v.detach().clone() for k, v in net.state_dict().items()}


def bare_engine(cfg: Any) -> tuple[list[float], list[float], dict[str, Any]]:
    """The reference: (a)'s step run by ignite's bare ``Engine`` (one handler: ``set_epoch``). Its distance to (a)
    is what ignite's loop costs; (b)'s distance to it is what ignite-mgpu's handlers and step add."""
    from ignite.engine import Engine, Events

    sampler, loader, model, net, optimizer, scheduler, loss_fn = _hand_built(cfg)

    def step(engine: Engine, batch: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.detach()

    engine = Engine(step)
    ms_per_iter, cpu_ms_per_iter, cpu_start = [], [], [0.0]

    def epoch_started(e: Engine) -> None:
        sampler.set_epoch(e.state.epoch - 1)
        cpu_start[0] = time.thread_time()

    def epoch_completed(e: Engine) -> None:
        cpu_ms_per_iter.append(1000 * (time.thread_time() - cpu_start[0]) / len(loader))
        ms_per_iter.append(1000 * e.state.times["EPOCH_COMPLETED"] / len(loader))

    engine.add_event_handler(Events.EPOCH_STARTED, epoch_started)
    engine.add_event_handler(Events.EPOCH_COMPLETED, epoch_completed)
    model.train()
    engine.run(loader, max_epochs=cfg.train.epochs)
    return ms_per_iter, cpu_ms_per_iter, {k: v.detach().clone() for k, v in net.state_dict().items()}


# ------------------------------------------------------------------------------------ (b) ignite-mgpu, and checks


def ignite_run(local_rank: int, cfg: Any) -> tuple[list[float], list[float], dict[str, Any]] | None:
    """(b): ``training`` itself. On rank 0 returns (ms per iteration of each epoch, CPU ms of the same, final
    weights). The CPU clock is read by two handlers added to the trainer that ``training`` builds (at the start of
    each epoch and after the trainer's own epoch-end handlers: the guard's check counts against (b))."""
    import torch.distributed as dist
    from ignite.engine import Engine, Events

    import ignite_mgpu.train
    from ignite_mgpu.checkpoint import read_checkpoint

    cpu_ms: list[float] = []
    create_trainer = ignite_mgpu.train.create_trainer

    def create_timed_trainer(*args: Any, **kwargs: Any) -> Engine:
        trainer = create_trainer(*args, **kwargs)
        started = [0.0]

        def epoch_started() -> None:
            started[0] = time.thread_time()

        def epoch_completed(engine: Engine) -> None:
            cpu_ms.append(1000 * (time.thread_time() - started[0]) / engine.state.epoch_length)

        trainer.add_event_handler(Events.EPOCH_STARTED, epoch_started)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, epoch_completed)
        return trainer

    ignite_mgpu.train.create_trainer = create_timed_trainer  # type: ignore[assignment]  # same signature
    try:
        ignite_mgpu.train.training(local_rank, cfg)
    finally:
        ignite_mgpu.train.create_trainer = create_trainer
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    out = Path(cfg.output_dir)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (final,) = out.glob("checkpoint_*.pt")  # checkpoint.every=epochs: exactly one, after the last epoch
    return [line["time_per_iter_ms"] for line in lines], cpu_ms, read_checkpoint(final)["model"]


def bitwise_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when both state_dicts hold the same keys and bit-identical tensors, else what differs."""
    import torch

    if a.keys() != b.keys():
        return f"different keys: {sorted(a.keys() ^ b.keys())[:4]}"
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{k}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
        if not torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)):
            return f"{k} differs (max abs(a-b) = {(x.double() - y.double()).abs().max().item():.3g})"
    return None


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
            cfg = make_config(workload, n, 1, worker_dir / f"calls-{workload}-{name}-{n}", nproc)
            if name == "hand-written":
                counts.append(count_calls(lambda c=cfg: hand_written(c), profile=rank == 0))
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

    Unpinned, the ranks migrate between the cores: on the 2-core CI machine that made the tiny MLP step about 1.7x
    slower and noisier, for (a) and (b) alike. Only the calling thread is pinned: gloo's threads, started earlier,
    stay free to run on any core (pinning them beside the main thread made the step slower again).
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < nproc:
        return None
    os.sched_setaffinity(0, {cores[rank]})  # Linux: pid 0 is the calling thread
    return cores[rank]


def session_worker(local_rank: int, spec: dict[str, Any]) -> None:
    """In every process: for each workload and round, run (a) and (b) and record rank 0's figures."""
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    core = pin_to_core(rank, spec["nproc"]) if spec["pin"] else None
    root = Path(spec["dir"])
    results: dict[str, Any] = {"runs": [], "calls": {}, "core": core}
    for workload in spec["workloads"]:
        for r in range(spec["rounds"]):
            runs = {}
            names = (*LOOPS, REFERENCE) if workload == "mlp" else LOOPS  # the reference where overhead shows
            for name in names if r % 2 == 0 else names[::-1]:  # a b, b a, a b, ...: a drift in load cancels
                out = root / f"{workload}-{name}-{r}"
                cfg = make_config(workload, spec["iters"][workload], 1 + spec["measured_epochs"], out, spec["nproc"])
                if name == "ignite-mgpu":
                    runs[name] = ignite_run(local_rank, cfg)
                else:
                    runs[name] = (hand_written if name == "hand-written" else bare_engine)(cfg)
                gc.collect()  # outside the timed epochs; both loops start with a clean heap
            if rank == 0:
                (ms_a, cpu_a, state_a), (ms_b, cpu_b, state_b) = runs["hand-written"], runs["ignite-mgpu"]
                record = {
                    "workload": workload,
                    "round": r,
                    "hand-written": min(ms_a[1:]),
                    "ignite-mgpu": min(ms_b[1:]),
                    "cpu": {"hand-written": min(cpu_a[1:]), "ignite-mgpu": min(cpu_b[1:])},
                    "difference": bitwise_difference(state_a, state_b),
                }
                if REFERENCE in runs:
                    ms_e, cpu_e, state_e = runs[REFERENCE]
                    record[REFERENCE] = min(ms_e[1:])
                    record["cpu"][REFERENCE] = min(cpu_e[1:])
                    record["difference"] = record["difference"] or bitwise_difference(state_a, state_e)
                results["runs"].append(record)
        if workload in spec["profile"]:
            results["calls"][workload] = calls_per_iteration(root, workload, spec["nproc"], local_rank, rank)
    if rank == 0:
        (root / "results.json").write_text(json.dumps(results))


def run_session(
    tmp: Path, nproc: int, workloads: list[str], rounds: int, iters: dict, epochs: int, profile: list[str], pin: bool
) -> dict:
    """One ``launch`` of ``nproc`` gloo processes in a fresh interpreter; returns rank 0's results."""
    spec = {
        "dir": str(tmp / f"session-{nproc}"),
        "nproc": nproc,
        "workloads": workloads,
        "rounds": rounds,
        "iters": iters,
        "measured_epochs": epochs,
        "profile": profile,
        "pin": pin,
    }
    Path(spec["dir"]).mkdir(parents=True)
    log = Path(spec["dir"], "session.log")
    with log.open("w") as f:
        code = subprocess.call([sys.executable, __file__, "--session", json.dumps(spec)], stdout=f, stderr=f)
    if code:
        sys.exit(
            f"benchmark session with {nproc} process(es) failed (exit {code}); its log:\n{log.read_text()[-4000:]}"
        )
    return json.loads(Path(spec["dir"], "results.json").read_text())


def session_main(spec_json: str) -> None:
    from ignite_mgpu import launch

    spec = json.loads(spec_json)
    launch(session_worker, spec, nproc=spec["nproc"], backend="gloo")


# ------------------------------------------------------------------------------------ start-up and --help


def reference_worker(rank: int, out: str) -> None:
    """The hand-written spawn script's worker: the default job's model and data, one DDP iteration."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 3, 32, 32, generator=g), torch.randint(10, (4096,), generator=g))
    net = nn.Sequential(  # the layers of ignite_mgpu.models.SimpleCNN
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )
    model = nn.parallel.DistributedDataParallel(net)
    sampler = DistributedSampler(data, 2, rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sampler.set_epoch(0)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    if rank == 0:
        Path(out, "first_iteration").write_text("done\n")
    dist.barrier()  # neither rank tears gloo down while the other may still be sending
    dist.destroy_process_group()


def console_script() -> str:
    """The ``ignite-mgpu`` script of this interpreter's environment (not a shell shim in front of it)."""
    local = Path(sys.executable).with_name("ignite-mgpu")
    return str(local) if local.exists() else (shutil.which("ignite-mgpu") or "ignite-mgpu")


def time_to_first_iteration(tmp: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds from starting the command to rank 0 finishing its first iteration (a marker file's mtime), and
    the CPU seconds the whole command used in all its processes (which other load on the machine barely changes).

    ignite-mgpu's marker is metrics.jsonl, written after its one-iteration epoch plus a 2-sample validation.
    """
    found: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in LOOPS}, "cpu": {n: [] for n in LOOPS}}
    for r in range(rounds):
        for name in LOOPS if r % 2 == 0 else LOOPS[::-1]:
            out = tmp / f"startup-{name}-{r}"
            if name == "hand-written":
                out.mkdir()
                cmd, marker = [sys.executable, __file__, "--reference-spawn", str(out)], out / "first_iteration"
            else:
                cmd = [
                    console_script(),
                    "train",
                    "--nproc",
                    "2",
                    "--backend",
                    "gloo",
                    "--output-dir",
                    str(out),
                    "train.epochs=1",
                    "train.epoch_length=1",
                    "data.val_size=2",
                    "checkpoint.every=0",
                    "train.progress_bar=false",
                ]
                marker = out / "metrics.jsonl"
            cpu = resource.getrusage(resource.RUSAGE_CHILDREN)  # children and grandchildren once waited for
            start = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode or not marker.exists():
                sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            found["wall"][name].append(marker.stat().st_mtime - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            found["cpu"][name].append(after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime)
    return found


def help_seconds(rounds: int) -> list[float]:
    found = []
    for _ in range(max(3, rounds)):
        start = time.perf_counter()
        subprocess.run([console_script(), "--help"], capture_output=True, check=True)
        found.append(time.perf_counter() - start)
    return found


# ------------------------------------------------------------------------------------ report


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


def paired(times: dict[str, list[float]]) -> list[float]:
    """(b) / (a) of each round: both ran back to back in the same processes, under the same load."""
    return [b / a for a, b in zip(times["hand-written"], times["ignite-mgpu"], strict=True)]


def verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "**no**")


def report(sessions: dict[int, dict], startup: dict | None, help_s: list[float], quick: bool) -> tuple[str, dict]:
    """The markdown tables and a JSON summary. Ratios only for workloads whose weights matched bit for bit."""
    lines = [
        "| workload | procs | loop | ms / iteration, median (min–max) | ignite-mgpu / hand-written, median of "
        "rounds (min–max) | best / best | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cpu_lines = [
        "",
        "| workload | procs | CPU ms / iteration of rank 0's training thread: hand-written | ignite-mgpu | "
        "extra CPU µs / iteration, median of rounds (min–max) | ignite-mgpu / hand-written, median of rounds |",
        "|---|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {"per_iteration": {}, "cpu_per_iteration": {}, "refused": []}
    for nproc, res in sorted(sessions.items(), reverse=True):
        for workload in dict.fromkeys(run["workload"] for run in res["runs"]):
            runs = [run for run in res["runs"] if run["workload"] == workload]
            a, b = [run["hand-written"] for run in runs], [run["ignite-mgpu"] for run in runs]
            bad = [run["difference"] for run in runs if run["difference"]]
            target = TARGETS[workload] if nproc == 2 else None
            title = WORKLOADS[workload][0]
            lines.append(f"| {title} | {nproc} | hand-written | {spread(a)} | | | | |")
            if bad:
                cell, best = f"refused: final weights differ in {len(bad)}/{len(runs)} runs ({bad[0]})", ""
                ok = False
                summary["refused"].append(f"{title}, {nproc} procs: {bad[0]}")
            else:
                ratios = paired({"hand-written": a, "ignite-mgpu": b})
                ok = statistics.median(ratios) <= target if target else None
                cell, best = spread(ratios), f"{min(b) / min(a):.3f}"
            lines.append(
                f"| {title} | {nproc} | ignite-mgpu | {spread(b)} | {cell} | {best} | "
                f"{f'≤ {target}' if target else '—'} | {verdict(ok)} |"
            )
            summary["per_iteration"][f"{workload}/{nproc}"] = {
                "hand-written": a,
                "ignite-mgpu": b,
                "met": ok,
                "identical": f"{len(runs) - len(bad)}/{len(runs)}",
            }
            if not bad and REFERENCE in runs[0]:
                e = [run[REFERENCE] for run in runs]
                lines.append(
                    f"| {title} | {nproc} | {REFERENCE} (reference; ratio over hand-written) | {spread(e)} | "
                    f"{spread([y / x for x, y in zip(a, e, strict=True)])} | {min(e) / min(a):.3f} | — | — |"
                )
                summary["per_iteration"][f"{workload}/{nproc}"][REFERENCE] = e
                cpu_e = [run["cpu"][REFERENCE] for run in runs]
                summary["cpu_per_iteration"][f"{workload}/{nproc}/{REFERENCE}"] = cpu_e
            if not bad:  # supporting figures, without a target: the CPU clock leaves out all waiting
                cpu = {name: [run["cpu"][name] for run in runs] for name in LOOPS}
                extra = [1000 * (b - a) for a, b in zip(cpu["hand-written"], cpu["ignite-mgpu"], strict=True)]
                cpu_lines.append(
                    f"| {title} | {nproc} | {spread(cpu['hand-written'])} | {spread(cpu['ignite-mgpu'])} | "
                    f"{spread(extra, 0)} | {statistics.median(paired(cpu)):.3f} |"
                )
                summary["cpu_per_iteration"][f"{workload}/{nproc}"] = cpu
    lines += cpu_lines
    lines += [
        "",
        "| measurement | hand-written | ignite-mgpu | comparison | target | met |",
        "|---|---|---|---|---|---|",
    ]
    per = summary["per_iteration"]
    if "cnn/1" in per and "cnn/2" in per and not summary["refused"]:
        # The global batch is the same with 1 and 2 processes, so the throughput ratio is t(1 proc) / t(2 procs).
        scale = {n: statistics.median(per["cnn/1"][n]) / statistics.median(per["cnn/2"][n]) for n in LOOPS}
        # ignite-mgpu's scaling over the hand-written loop's is (b/a at 1 proc) / (b/a at 2 procs); taken from the
        # paired per-round ratios, since only (a) and (b) of the same round ran under the same load.
        rel = statistics.median(paired(per["cnn/1"])) / statistics.median(paired(per["cnn/2"]))
        ok = abs(rel - 1) <= TARGETS["scaling"]
        summary["scaling"] = scale | {"relative": rel, "met": ok}
        lines.append(
            f"| small CNN throughput, 2 procs / 1 proc | {scale['hand-written']:.3f}× | {scale['ignite-mgpu']:.3f}× "
            f"| {rel:.3f} | within ±{TARGETS['scaling']:.0%} | {verdict(ok)} |"
        )
    else:
        why = "refused: final weights differ" if summary["refused"] else "skipped (--quick)"
        lines.append(f"| small CNN throughput, 2 procs / 1 proc | {why} | | | | |")
    if startup:
        wall, cpu = startup["wall"], startup["cpu"]
        rel = statistics.median(wall["ignite-mgpu"]) / statistics.median(wall["hand-written"])
        ok = rel <= TARGETS["startup"]
        summary["startup"] = startup | {"relative": rel, "met": ok}
        lines.append(
            f"| launch → first finished iteration, 2 procs (s) | {spread(wall['hand-written'], 2)} | "
            f"{spread(wall['ignite-mgpu'], 2)} | {rel:.2f}× | ≤ {TARGETS['startup']}× | {verdict(ok)} |"
        )
        rel_cpu = statistics.median(cpu["ignite-mgpu"]) / statistics.median(cpu["hand-written"])
        lines.append(
            f"| CPU seconds of that whole command, all processes | {spread(cpu['hand-written'], 2)} | "
            f"{spread(cpu['ignite-mgpu'], 2)} | {rel_cpu:.2f}× | — | — |"
        )
    else:
        lines.append("| launch → first finished iteration, 2 procs (s) | skipped (--quick) | | | | |")
    ok = statistics.median(help_s) < TARGETS["help_s"]
    summary["help_s"] = {"values": help_s, "met": ok}
    lines.append(f"| `ignite-mgpu --help` (s) | | {spread(help_s, 3)} | | < {TARGETS['help_s']} s | {verdict(ok)} |")
    calls = sessions.get(2, {}).get("calls", {})
    for workload, c in calls.items():
        ok = c["extra"] <= TARGETS["calls"]
        lines.append(
            f"| Python calls / iteration, rank 0, {WORKLOADS[workload][0]} (cProfile) | {c['hand-written']:.1f} "
            f"| {c['ignite-mgpu']:.1f} | +{c['extra']:.1f} | ≤ +{TARGETS['calls']} | {verdict(ok)} |"
        )
    summary["calls"] = calls
    if quick:
        lines += ["", "(--quick: one short round; the timings are not meaningful, only the checks are)"]
    return "\n".join(lines), summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="(a, b) pairs per workload [5]")
    parser.add_argument("--iters", type=int, help="iterations per measured epoch [mlp 500, cnn 40]")
    parser.add_argument("--quick", action="store_true", help="one short round, MLP and CNN on 2 procs only")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    parser.add_argument("--no-pin", action="store_true", help="leave the processes unpinned (default: 1 core each)")
    parser.add_argument("--session", help=argparse.SUPPRESS)
    parser.add_argument("--reference-spawn", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.session:
        session_main(args.session)
        return 0
    if args.reference_spawn:
        import torch.multiprocessing as mp

        mp.spawn(reference_worker, args=(args.reference_spawn,), nprocs=2)
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
