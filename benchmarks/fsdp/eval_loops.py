"""Evaluation compared: ignite-mgpu's evaluator (``create_evaluator`` with ``validation_metrics``, as ``training``
builds it) against a hand-written ``torch.no_grad()`` loop that computes the same metrics (loss, and accuracy for
cross-entropy) with one all-reduce at the end, on the same prepared model; and, as the reference, ignite's bare
``Engine`` running the hand-written loop's work. Passes over the validation split take turns, and every loop's
metrics must equal the hand-written loop's."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# workload -> title, validation samples (default, --quick): 2 processes x the per-process batches of one pass. The
# FSDP one first: ``built`` sets the CPU allocator up as each job does (``setup_cpu_memory``), which is process-wide
# and for good: the DDP job keeps freed memory, the FSDP job leaves malloc as it is.
REFERENCE = "ignite Engine"  # the hand-written loop's work in ignite's bare Engine: what ignite's loop itself costs
WORKLOADS = {
    "gpt2": ("tiny GPT-2 (FSDP)", 256, 64),  # batch 16 (8 per process): 16 batches per process and pass
    "cnn": ("small CNN (DDP)", 2048, 512),  # batch 128 (64 per process): 16 batches per process and pass
}


def make_config(workload: str, val_size: int, output_dir: Any, nproc: int) -> Any:
    """The workload's job config with ``val_size`` validation samples (the step benchmarks' configs)."""
    if workload == "cnn":
        from benchmarks.overhead.loops import make_config as overhead_config

        cfg = overhead_config("cnn", 8, 1, output_dir, nproc)
        cfg.data.val_size = val_size
        return cfg
    from benchmarks.fsdp.step_loops import BATCH
    from benchmarks.fsdp.step_loops import make_config as fsdp_config

    cfg = fsdp_config("gpt2", 8, 1, output_dir, nproc)
    cfg.data.args = {"train": 8 * BATCH, "val": val_size}
    return cfg


def built(cfg: Any) -> dict[str, Any]:
    """The model, loss, evaluator and validation loader as ``training(cfg)`` builds them, with the CPU allocator set
    up as it sets it up (both loops run with it), and the hand-written loop's own loader over the same validation
    split (each rank every world-size-th sample, unpadded)."""
    import ignite.distributed as idist
    from torch.utils.data import DataLoader, Subset

    import ignite_mgpu.train.default_job as job
    from ignite_mgpu.parallel.strategy import find_ddp
    from ignite_mgpu.train.allocator import setup_cpu_memory
    from ignite_mgpu.train.data.loaders import create_dataloaders
    from ignite_mgpu.train.evaluator import create_evaluator, validation_metrics
    from ignite_mgpu.train.losses import create_loss

    world, rank = idist.get_world_size(), idist.get_rank()
    setup_cpu_memory(cfg.train.keep_cpu_memory, idist.device().type, sharded=job.sharding(cfg, world))
    train_loader, val_loader = create_dataloaders(cfg.data, cfg.model.num_classes, cfg.seed)
    model = job._create_model(cfg, train_loader)
    loss_fn = create_loss(cfg.train.loss, cfg.train.loss_args)
    metrics = validation_metrics(loss_fn, idist.device(), cfg.eval.metrics, cfg.eval.metric_args)
    evaluator = create_evaluator(model, metrics, model_loss=loss_fn is None, precision=cfg.train.precision)
    val_ds = val_loader.dataset
    mine = Subset(val_ds, range(rank, len(val_ds), world))  # type: ignore[arg-type]  # sized
    hand_loader = DataLoader(mine, batch_size=cfg.data.batch_size // world)
    ddp = find_ddp(model)
    net = ddp.module if ddp is not None else model  # DDP's forward would broadcast buffers: its module, as ours
    return {
        "evaluator": evaluator,
        "val_loader": val_loader,
        "hand_loader": hand_loader,
        "net": net,
        "loss_fn": loss_fn,
    }


def hand_evaluate(net: Any, loader: Any, loss_fn: Any) -> dict[str, float]:
    """The hand-written evaluation: no_grad forwards, the loss weighted by each batch's size (and the correct
    predictions for cross-entropy) summed on this rank, one all-reduce at the end. ``loss_fn`` None: the model
    computes its own loss from the batch's labels (a Hugging Face causal LM). One process: no all-reduce."""
    import torch

    net.eval()
    sums = Sums()
    with torch.no_grad():
        for batch in loader:
            sums.add(net, batch, loss_fn)
    return sums.result(loss_fn)


class Sums:
    """The hand-written loop's per-batch work and its end: this rank's sums, then one all-reduce."""

    def __init__(self) -> None:
        import torch

        self.loss, self.correct, self.count = torch.zeros(()), torch.zeros((), dtype=torch.long), 0

    def add(self, net: Any, batch: Any, loss_fn: Any) -> None:
        import torch

        if loss_fn is None:
            n = len(batch["input_ids"])
            self.loss += net(**batch).loss.float() * n
        else:
            x, y = batch[0], batch[1]
            n = len(y)
            out = net(x).float()
            self.loss += loss_fn(out, y) * n
            self.correct += torch.eq(torch.argmax(out, dim=1), y).sum()
        self.count += n

    def result(self, loss_fn: Any) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        totals = torch.stack([self.loss, self.correct.float(), torch.tensor(float(self.count))])
        if dist.is_initialized():
            dist.all_reduce(totals)
        result = {"loss": totals[0].item() / int(totals[2].item())}
        if loss_fn is not None:
            result["accuracy"] = int(totals[1].item()) / int(totals[2].item())
        return result


def engine_loop(net: Any, loader: Any, loss_fn: Any) -> Callable[[], dict[str, float]]:
    """The reference: ignite's bare ``Engine`` (built once, as ignite-mgpu's evaluator is) running the hand-written
    loop's per-batch work over the same loader, with no handler and no metric: what ignite's loop itself costs."""
    import torch
    from ignite.engine import Engine

    sums = [Sums()]
    engine = Engine(lambda _, batch: sums[0].add(net, batch, loss_fn))

    def evaluate() -> dict[str, float]:
        net.eval()
        sums[0] = Sums()
        with torch.no_grad():
            engine.run(loader)
        return sums[0].result(loss_fn)

    return evaluate


def ignite_evaluate(parts: dict[str, Any]) -> dict[str, float]:
    """ignite-mgpu's evaluator over its validation loader, as the trainer runs it after every epoch."""
    return dict(parts["evaluator"].run(parts["val_loader"]).metrics)


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def loops_of(parts: dict[str, Any], reference: bool = False) -> dict[str, Any]:
    """The evaluation loops over ``built(cfg)``'s parts, as functions of no argument returning the metrics: the
    hand-written one and ignite-mgpu's, and with ``reference`` ignite's bare ``Engine`` (REFERENCE)."""
    args = (parts["net"], parts["hand_loader"], parts["loss_fn"])
    loops = {"hand-written": lambda: hand_evaluate(*args), "ignite-mgpu": lambda: ignite_evaluate(parts)}
    return loops | ({REFERENCE: engine_loop(*args)} if reference else {})


def difference(results: dict[str, dict[str, float]]) -> str | None:
    """None when every other loop's metrics equal the hand-written loop's (the same names, the same floats)."""
    hand = results["hand-written"]
    for name, found in results.items():
        if (other := {k: found.get(k) for k in hand}) != hand:
            return f"hand-written {hand}, {name} {other}"
    return None


def evaluation_turns(parts: dict[str, Any], passes: int) -> tuple[dict[str, list[tuple[float, float]]], list[str]]:
    """``passes`` passes of each loop (the reference's too) over the validation split, taking turns (the order
    rotating); returns each loop's (wall s, CPU s) per pass after the first two (warm-up), and every pass whose
    metrics differed."""
    loops = loops_of(parts, reference=True)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in loops}
    differences = []
    for p in range(passes + 2):
        names = list(loops)[p % len(loops) :] + list(loops)[: p % len(loops)]
        results = {}
        for name in names:
            start = clocks()
            results[name] = loops[name]()
            end = clocks()
            if p >= 2:
                times[name].append((end[0] - start[0], end[1] - start[1]))
        if (found := difference(results)) is not None:
            differences.append(f"pass {p}: {found}")
    return times, differences
