"""What ignite-mgpu costs over a hand-written PyTorch DDP loop, on 2 gloo processes with one thread each.

Measures, with (a) a hand-written loop and (b) ``ignite_mgpu.train.training`` as ``ignite-mgpu train`` runs it:
time per iteration on a tiny MLP and on the default small CNN, 2-vs-1 process scaling, launch to the first
finished iteration, ``ignite-mgpu --help``, and the extra Python calls per iteration (cProfile, rank 0).
(a) and (b) take turns inside one run of (b), in the same worker processes; a ratio is printed only when their final
weights are bit-identical, which proves that both did the same work.

Run: python benchmarks/bench_overhead.py [--rounds 5] [--iters N] [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator
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
BOOTSTRAP = 2000  # resamples for each 95 % interval
TARGETS = {"mlp": 1.03, "cnn": 1.01, "scaling": 0.02, "startup": 1.15, "help_s": 0.3, "calls": 100}
PROFILE_ITERS = (20, 60)  # call counts are taken at two run lengths; the difference cancels set-up and teardown
# Each round is one run of (b), 1 warm-up epoch (allocations, DDP buckets) and then measured epochs, in which the
# loops take turns TURNS_PER_EPOCH times per epoch (about 0.15 s a turn with the default iterations).
MEASURED_EPOCHS = 3
TURNS_PER_EPOCH = 5
LOOPS = ("hand-written", "ignite-mgpu")
REFERENCE = "ignite Engine"  # (a)'s step in ignite's bare Engine: what ignite's loop itself costs


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


def weights(net: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def hand_steps(built: tuple[Any, ...], epochs: int, window: int | None) -> Generator[None, None, dict[str, Any]]:
    """(a): the job of ``training(cfg)`` written out by hand, without engine, handlers or validation.

    A generator: it pauses after every ``window`` iterations (never when ``window`` is None) and returns the final
    weights. ``built`` is ``_hand_built(cfg)``.
    """
    sampler, loader, model, net, optimizer, scheduler, loss_fn = built
    model.train()
    done = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            scheduler.step()
            done += 1
            if window and done % window == 0:
                yield
    return weights(net)


def engine_steps(built: tuple[Any, ...], epochs: int, window: int) -> Generator[None, None, dict[str, Any]]:
    """The reference: (a)'s step run by ignite's bare ``Engine`` (handlers: ``set_epoch``, and the pause after every
    ``window`` iterations, an ``Engine.interrupt``; the next ``run`` resumes). Its distance to (a) is what ignite's
    loop costs; (b)'s distance to it is what ignite-mgpu's step and handlers add."""
    from ignite.engine import Engine, Events

    sampler, loader, model, net, optimizer, scheduler, loss_fn = built

    def step(engine: Engine, batch: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.detach()

    engine, paused = Engine(step), [False]

    def pause(e: Engine) -> None:  # a plain handler: a filtered event (every=) costs 13 Python calls per iteration
        if e.state.iteration % window == 0:
            paused[0] = True
            e.interrupt()

    engine.add_event_handler(Events.EPOCH_STARTED, lambda e: sampler.set_epoch(e.state.epoch - 1))
    engine.add_event_handler(Events.ITERATION_COMPLETED, pause)
    model.train()
    while True:
        paused[0] = False
        engine.run(loader, max_epochs=epochs)
        if not paused[0]:
            return weights(net)
        yield


def finish(steps: Generator[None, None, dict[str, Any]]) -> dict[str, Any]:
    """Run a loop to its end; its final weights."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def clocks() -> tuple[float, float]:
    """Wall clock, and the CPU clock of this thread (which leaves out waiting for the other rank or for a core)."""
    return time.perf_counter(), time.thread_time()


class Turns:
    """Makes the loops take turns inside (b)'s run: after every ``window`` iterations of (b) (a handler on the
    trainer ``training`` builds), each other loop runs its next ``window`` iterations, in alternating order. Every
    turn of every loop is timed (wall and CPU) from the second epoch on; the first warms up. (b)'s turns start at its
    epochs' start and end after its per-iteration handlers; epoch-end work (validation, the epoch report) is not
    timed for any loop.
    """

    def __init__(self, others: dict[str, Generator[None, None, dict[str, Any]]], window: int) -> None:
        self.others, self.window = others, window
        self.turns: dict[str, list[tuple[float, float]]] = {name: [] for name in ("ignite-mgpu", *others)}
        self._start: tuple[float, float] | None = None
        self._count = 0

    def attach(self, trainer: Any) -> None:
        from ignite.engine import Events

        trainer.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._switch)  # not every=: see engine_steps

    def _epoch_started(self, engine: Any) -> None:
        self._start = clocks() if engine.state.epoch > 1 else None

    def _record(self, name: str, start: tuple[float, float], end: tuple[float, float]) -> None:
        self.turns[name].append((end[0] - start[0], end[1] - start[1]))

    def _switch(self, engine: Any) -> None:
        if engine.state.iteration % self.window:
            return
        end = clocks()
        if self._start is not None:
            self._record("ignite-mgpu", self._start, end)
        measured = engine.state.epoch > 1
        self._count += 1
        names = list(self.others)
        for name in names if self._count % 2 else names[::-1]:
            start = clocks()
            next(self.others[name])
            if measured:
                self._record(name, start, clocks())
        epoch_end = engine.state.iteration % engine.state.epoch_length == 0
        self._start = clocks() if measured and not epoch_end else None


# ------------------------------------------------------------------------------------ (b) ignite-mgpu, and checks


def ignite_run(local_rank: int, cfg: Any, turns: Turns | None = None) -> dict[str, Any] | None:
    """(b): ``training`` itself, with ``turns`` attached to its trainer (by wrapping
    ``ignite_mgpu.train.create_trainer``). Rank 0 returns the final weights, read from the last checkpoint."""
    import torch.distributed as dist

    import ignite_mgpu.train
    from ignite_mgpu.checkpoint import read_checkpoint

    create_trainer = ignite_mgpu.train.create_trainer

    def create_taking_turns(*args: Any, **kwargs: Any) -> Any:
        trainer = create_trainer(*args, **kwargs)
        if turns is not None:
            turns.attach(trainer)
        return trainer

    ignite_mgpu.train.create_trainer = create_taking_turns  # type: ignore[assignment]  # same signature
    try:
        ignite_mgpu.train.training(local_rank, cfg)
    finally:
        ignite_mgpu.train.create_trainer = create_trainer
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    (final,) = Path(cfg.output_dir).glob("checkpoint_*.pt")  # checkpoint.every=epochs: one, after the last epoch
    return read_checkpoint(final)["model"]


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
            cfg = make_config(workload, n, 1, worker_dir / f"calls-{workload}-{name}-{n}", nproc)  # 1 epoch
            if name == "hand-written":
                counts.append(count_calls(lambda c=cfg: finish(hand_steps(_hand_built(c), 1, None)), rank == 0))
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
            # Built before (b) starts: _hand_built seeds the generator as training() does when it builds its model.
            others = {
                "hand-written": hand_steps(_hand_built(cfg), epochs, window),
                REFERENCE: engine_steps(_hand_built(cfg), epochs, window),
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


def report(sessions: dict[int, dict], startup: dict | None, help_s: list[float], quick: bool) -> tuple[str, dict]:
    """The markdown tables and a JSON summary. Ratios only for workloads whose weights matched bit for bit."""
    lines = [
        "| workload | procs | loop | ms / iteration, median of rounds (min–max) | ratio over hand-written, all turns "
        "[95 % interval] | median of rounds (min–max) | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cpu_lines = [
        "",
        "| workload | procs | loop | CPU ms / iteration of rank 0's training thread, median of rounds (min–max) | "
        "extra CPU µs / iteration over hand-written, all turns [95 % interval] |",
        "|---|---|---|---|---|",
    ]
    over_lines = [
        "",
        "| workload | procs | ignite-mgpu / ignite's bare Engine, all turns [95 % interval] | "
        "extra CPU µs / iteration over it, rank 0 [95 % interval] |",
        "|---|---|---|---|",
    ]
    summary: dict[str, Any] = {"per_iteration": {}, "refused": []}
    for nproc, res in sorted(sessions.items(), reverse=True):
        for workload in dict.fromkeys(run["workload"] for run in res["runs"]):
            runs = [run for run in res["runs"] if run["workload"] == workload]
            bad = [run["difference"] for run in runs if run["difference"]]
            title, key = WORKLOADS[workload][0], f"{workload}/{nproc}"
            target = TARGETS[workload] if nproc == 2 else None
            names = [name for name in (*LOOPS, REFERENCE) if name in runs[0]["turns"]]
            entry: dict[str, Any] = {"identical": f"{len(runs) - len(bad)}/{len(runs)}", "loops": {}}
            summary["per_iteration"][key] = entry
            for name in names:
                ms, cpu_ms = per_round_ms(runs, name), per_round_ms(runs, name, clock=1)
                entry["loops"][name] = {"ms_per_round": ms, "cpu_ms_per_round": cpu_ms}
                label = name if name != REFERENCE else f"{REFERENCE} (reference)"
                cells = ["", "", "", ""]
                cpu_cell = ""
                if name != "hand-written" and bad:
                    cells[0] = f"refused: final weights differ in {len(bad)}/{len(runs)} runs ({bad[0]})"
                    if name == "ignite-mgpu":
                        summary["refused"].append(f"{title}, {nproc} procs: {bad[0]}")
                        entry["met"] = False
                elif name != "hand-written":
                    ratio, low, high = ratio_over(runs, name, "hand-written")
                    rounds = [b / a for a, b in zip(per_round_ms(runs, "hand-written"), ms, strict=True)]
                    cells[0], cells[1] = interval_cell(ratio, low, high), spread(rounds)
                    cpu_cell = interval_cell(*extra_cpu_over(runs, name, "hand-written"), scale=1e6, digits=0)
                    entry["loops"][name] |= {"ratio": ratio, "interval": [low, high], "ratio_per_round": rounds}
                    if name == "ignite-mgpu" and target:
                        entry["met"] = verdict(low, high, 0.0, target)
                        cells[2], cells[3] = f"≤ {target}", entry["met"]
                lines.append(f"| {title} | {nproc} | {label} | {spread(ms)} | {' | '.join(cells)} |")
                cpu_lines.append(f"| {title} | {nproc} | {label} | {spread(cpu_ms)} | {cpu_cell} |")
            if REFERENCE in names and not bad:  # what ignite-mgpu's step and handlers add to ignite's own loop
                ratio, low, high = ratio_over(runs, "ignite-mgpu", REFERENCE)
                extra = extra_cpu_over(runs, "ignite-mgpu", REFERENCE)
                entry["over_reference"] = {"ratio": ratio, "interval": [low, high], "extra_cpu_s": extra[0]}
                over_lines.append(
                    f"| {title} | {nproc} | {interval_cell(ratio, low, high)} | "
                    f"{interval_cell(*extra, scale=1e6, digits=0)} |"
                )
    lines += cpu_lines + over_lines
    lines += [
        "",
        "| measurement | hand-written | ignite-mgpu | comparison | target | met |",
        "|---|---|---|---|---|---|",
    ]
    per = summary["per_iteration"]
    if "cnn/1" in per and "cnn/2" in per and not summary["refused"]:
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
        lines.append(
            f"| small CNN throughput, 2 procs / 1 proc | {scale['hand-written']:.3f}× | {scale['ignite-mgpu']:.3f}× "
            f"| {interval_cell(rel, low, high)} | within ±{TARGETS['scaling']:.0%} | {met} |"
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
            f"{spread(wall['ignite-mgpu'], 2)} | {rel:.2f}× | ≤ {TARGETS['startup']}× | {yes_no(ok)} |"
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
    lines.append(f"| `ignite-mgpu --help` (s) | | {spread(help_s, 3)} | | < {TARGETS['help_s']} s | {yes_no(ok)} |")
    calls = sessions.get(2, {}).get("calls", {})
    for workload, c in calls.items():
        ok = c["extra"] <= TARGETS["calls"]
        lines.append(
            f"| Python calls / iteration, rank 0, {WORKLOADS[workload][0]} (cProfile) | {c['hand-written']:.1f} "
            f"| {c['ignite-mgpu']:.1f} | +{c['extra']:.1f} | ≤ +{TARGETS['calls']} | {yes_no(ok)} |"
        )
    summary["calls"] = calls
    if quick:
        lines += ["", "(--quick: one short round; the timings are not meaningful, only the checks are)"]
    return "\n".join(lines), summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs per workload and process count [5]")
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
