"""The loops being compared: (a) hand-written, the bare-ignite-Engine reference and (b) ignite-mgpu's ``training``, the
workloads they train, the turns they take inside (b)'s run, and the bitwise comparison of their final weights."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

WORKLOADS = {  # name -> title, global batch, iterations per measured epoch (default, --quick), config overrides
    "mlp": ("tiny MLP", 32, 500, 30, ["model.name=mlp", "data.image_size=8", "data.batch_size=32"]),
    "cnn": ("small CNN", 128, 40, 6, ["model.name=simple_cnn"]),
}
LOOPS = ("hand-written", "ignite-mgpu")
REFERENCE = "ignite Engine"  # (a)'s step in ignite's bare Engine: what ignite's loop itself costs


def make_config(
    workload: str, iters: int, epochs: int, output_dir: str | Path, nproc: int, extra: Sequence[str] = ()
) -> Any:
    """The run's Config, built like ``ignite-mgpu train`` builds it (defaults < overrides, then validated).

    One epoch is one full pass (train_size = iters * batch), so every epoch starts a fresh, re-shuffled
    sampler pass. The full checkpoint is written once, after the last epoch, outside the timed part: it holds
    the final weights compared with (a). Validation runs on 256 samples (also outside the timed part). ``extra``:
    more dotted overrides, applied last.
    """
    from ignite_mgpu.config.loading import load_config

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
            *extra,
        ],
    )


# ------------------------------------------------------------------------------------ (a) the hand-written loop


def hand_built(cfg: Any) -> tuple[Any, ...]:
    """What (a) and the bare-Engine reference build by hand: sampler, loader, model (DDP when distributed), its
    unwrapped module, optimizer, LR schedule, loss. Model, data, optimizer and schedule come from ignite_mgpu's
    factories, so every loop starts from the same objects as ``training(cfg)``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from ignite_mgpu.train.data.datasets import build_datasets
    from ignite_mgpu.train.models import create_model
    from ignite_mgpu.train.optim import create_lr_scheduler, create_optimizer

    distributed = dist.is_available() and dist.is_initialized()
    world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    torch.manual_seed(cfg.seed)  # the generator state training() has when it builds the model
    train_ds = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed).train
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
    weights. ``built`` is ``hand_built(cfg)``.
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


def engine_step(built: tuple[Any, ...]) -> Any:
    """(a)'s step as an ignite process function: what the bare-Engine reference runs. ``built`` is
    ``hand_built(cfg)``."""
    _, _, model, _, optimizer, scheduler, loss_fn = built

    def step(engine: Any, batch: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.detach()

    return step


def engine_steps(built: tuple[Any, ...], epochs: int, window: int) -> Generator[None, None, dict[str, Any]]:
    """The reference: (a)'s step run by ignite's bare ``Engine`` (handlers: ``set_epoch``, and the pause after every
    ``window`` iterations, an ``Engine.interrupt``; the next ``run`` resumes). Its distance to (a) is what ignite's
    loop costs; (b)'s distance to it is what ignite-mgpu's step and handlers add."""
    from ignite.engine import Engine, Events

    sampler, loader, model, net = built[:4]
    engine, paused = Engine(engine_step(built)), [False]

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


# ------------------------------------------------------------------------------------ (b) ignite-mgpu, and the check


def ignite_run(local_rank: int, cfg: Any, turns: Turns | None = None) -> dict[str, Any] | None:
    """(b): ``training`` itself, with ``turns`` attached to its trainer (by wrapping
    ``ignite_mgpu.train.default_job.create_trainer``). Rank 0 returns the final weights, read from the last
    checkpoint."""
    import torch.distributed as dist

    import ignite_mgpu.train.default_job
    from ignite_mgpu.checkpoint.files import read_checkpoint

    create_trainer = ignite_mgpu.train.default_job.create_trainer

    def create_taking_turns(*args: Any, **kwargs: Any) -> Any:
        trainer = create_trainer(*args, **kwargs)
        if turns is not None:
            turns.attach(trainer)
        return trainer

    ignite_mgpu.train.default_job.create_trainer = create_taking_turns  # type: ignore[assignment]  # same signature
    try:
        ignite_mgpu.train.default_job.training(local_rank, cfg)
    finally:
        ignite_mgpu.train.default_job.create_trainer = create_trainer
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
