"""The measured side of bench_memory_plan.py: the resident high-water mark that a real training step adds to a
process, on the CPU, per rank (1 process, or 2 gloo processes under DDP or FSDP2).

Each rank builds the datasets and joins its group, then resets the kernel's high-water mark (``VmHWM``, by writing
5 to ``/proc/self/clear_refs``), notes its resident size, and only then collates its share of the batch, builds the
model, wraps it (``prepare_model``), creates the optimizer and runs the same steps as the plan (forward, loss,
backward, clipping, optimizer step, gradients set to None). Its figure is ``VmHWM`` afterwards minus the resident
size before: every byte the kernel gave the process for the step, measured without PyTorch's help (the estimate's
own mechanism, a dispatch mode over storages, is not used here). Run through bench_memory_plan.py.
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's <malloc.h>
GLIBC_RETURNS_MEMORY = True  # each worker calls return_freed_memory() first (bench_memory_plan.py --malloc)


def _status(field: str) -> int:
    """A ``/proc/self/status`` line in bytes (VmRSS, VmHWM: the kernel writes them in kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_high_water_mark() -> int:
    """Reset VmHWM to the resident size now; returns that size."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _step(cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> None:
    from ignite_mgpu.train.data import batches
    from ignite_mgpu.train.losses import create_loss

    loss_fn = create_loss(cfg.train.loss, cfg.train.loss_args, device="cpu")
    if loss_fn is None:
        loss = batches.loss_of(batches.model_loss(model, batch))
    elif isinstance(batch, dict):
        inputs, targets = batches.split(batch)
        loss = loss_fn(batches.logits(model(**inputs)), targets)
    else:
        loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    del loss
    if cfg.train.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_rank(cfg: Any, strategy: str, local_batch: int, steps: int = 2) -> int:
    """This process's high-water mark over building the model and ``steps`` real steps, minus what it held before."""
    from ignite_mgpu.parallel.strategy import prepare_model
    from ignite_mgpu.train.data.datasets import build_datasets, example_inputs, first_batch
    from ignite_mgpu.train.models import create_model
    from ignite_mgpu.train.optim import create_optimizer

    torch.manual_seed(cfg.seed)
    splits = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
    example = example_inputs(splits.train, splits.collate_fn)

    def steps_on(size: int) -> None:
        batch = first_batch(splits.train, splits.collate_fn, size)
        model = prepare_model(create_model(cfg.model, example), strategy, precision=cfg.train.precision)
        o = cfg.optim
        optimizer = create_optimizer(model, o.name, o.lr, o.momentum, o.weight_decay, o.nesterov, args=o.args)
        model.train()
        for _ in range(steps):
            _step(cfg, model, optimizer, batch)

    # A first run on 2 samples pages in the code and the libraries' one-time buffers (oneDNN, gloo, the fake-free
    # parts of the interpreter), which the step itself does not hold; what it freed goes back to the kernel.
    steps_on(2)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = reset_high_water_mark()
    steps_on(local_batch)
    return _status("VmHWM") - before


def return_freed_memory() -> None:
    """Make glibc serve every block above 64 KiB with its own mapping, given back on free (no dynamic threshold,
    no heap kept): the resident size then follows the bytes the tensors hold, as a GPU's allocated memory does."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def _worker(
    rank: int, world_size: int, init: str, cfg: Any, strategy: str, local_batch: int, out: str, returns: bool
) -> None:
    if returns:
        return_freed_memory()
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        Path(out, f"rank{rank}").write_text(str(measure_rank(cfg, strategy, local_batch)))
        if world_size > 1:
            dist.barrier()  # neither rank exits while a gloo thread may still release its last collective (SIGABRT)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def measure(cfg: Any, strategy: str, world_size: int, local_batch: int) -> list[int]:
    """Each rank's measured peak in bytes, ``world_size`` fresh processes (spawned: a clean high-water mark)."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        args = (world_size, init, cfg, strategy, local_batch, tmp, GLIBC_RETURNS_MEMORY)
        mp.spawn(_worker, args, nprocs=world_size, join=True)
        return [int(Path(tmp, f"rank{r}").read_text()) for r in range(world_size)]
