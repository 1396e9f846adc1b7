"""``train.micro_batch``: each process's batch split into parts inside one iteration, the gradient that of the whole
batch with one gradient sync; ``auto`` finds the largest part that fits by shrinking on a real out-of-memory error,
agreed by every rank and remembered in the run folder. The step itself is ``micro_step.py``'s."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ignite_mgpu.train.data import batches
from ignite_mgpu.train.data.batches import Batch

logger = logging.getLogger("ignite_mgpu")
# What the allocators say when memory runs out: CUDA's OutOfMemoryError (also caught by type), PyTorch's CPU
# allocator ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ...") and the allocators that
# report "not enough memory" (Windows' CPU allocator, some vendor backends).
# The allocators' messages, cuBLAS's failed workspace allocation, and cuDNN's "not supported" that a batch too large
# for its kernels raises (pytorch/pytorch#4107; Lightning's utilities/memory.py counts it too).
OUT_OF_MEMORY = (
    "CUDA out of memory",
    "can't allocate memory",
    "not enough memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",
)
# The layers whose training forward computes statistics over the batch: a part that pads is empty in a model that
# holds one (torch's BatchNorm and SyncBatchNorm leave an empty input out of their statistics, running ones too).
BATCH_NORMS = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
)  # fmt: skip
# auto: iterations that a size must have held before the last part syncs through DDP's own overlapped backward;
# until then every part runs without sync and the gradients are all-reduced after the ranks agreed (micro_step.py).
SETTLE_ITERATIONS = 20


class MicroBatchTooLarge(RuntimeError):
    """An out-of-memory error that the ranks could not retry together (inside a collective): the smaller size is
    remembered in the run folder, and the job's restart (``dist.max_restarts``) starts from it."""


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is memory running out: CUDA's ``OutOfMemoryError``, an allocator's or a CUDA library's
    RuntimeError (``OUT_OF_MEMORY``, or "CUDA error: out of memory" from outside the caching allocator)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if not isinstance(err, RuntimeError):
        return False
    message = str(err)
    return any(m in message for m in OUT_OF_MEMORY) or ("CUDA" in message and "out of memory" in message)


def next_size(size: int) -> int:
    """The size to try after ``size`` samples ran out of memory: half, rounded up (10: 5, 3, 2, 1); 0 after 1."""
    return (size + 1) // 2 if size > 1 else 0


def split_batch(batch: Batch, n: int, size: int) -> list[tuple[Batch, int]]:
    """``batch`` (``n`` samples) as parts of at most ``size`` samples, each with its count; the last part holds the
    rest (10 in parts of 4: 4, 4, 2). Every tensor whose first dimension is ``n`` is sliced, anything else is
    given to every part as it is."""
    if size >= n:
        return [(batch, n)]
    return [(_slice(batch, n, start, min(start + size, n)), min(size, n - start)) for start in range(0, n, size)]


def padded(parts: list[tuple[Batch, int]], batch: Batch, n: int, count: int, empty: bool) -> list[tuple[Batch, int]]:
    """``parts`` and after them zero-weight parts (counted as 0 samples) up to ``count``, so that a rank with a
    smaller share runs as many forwards and backwards, and so as many collectives, as the rank with the most: the
    batch's first sample again, or with ``empty`` none of its samples (for ``BATCH_NORMS``: a repeated sample would
    count in the running statistics, and under SyncBatchNorm in every rank's batch statistics)."""
    filler = _slice(batch, n, 0, 0 if empty else 1)
    return parts + [(filler, 0)] * (count - len(parts))


def _slice(value: Any, n: int, start: int, stop: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.dim() > 0 and len(value) == n else value
    if isinstance(value, (list, tuple)):
        parts = [_slice(v, n, start, stop) for v in value]
        kind = type(value)
        if kind is list or kind is tuple:
            return parts if kind is list else tuple(parts)
        return kind(*parts) if hasattr(value, "_fields") else kind(parts)
    if isinstance(value, Mapping):
        return {k: _slice(v, n, start, stop) for k, v in value.items()}
    return value


def counted_items(batch: Batch) -> int | None:
    """The labels a token-level loss counts in a mapping batch (Hugging Face's ``num_items_in_batch``: labels other
    than -100), or None for a batch without a labels tensor."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    return int(labels.ne(-100).sum()) if isinstance(labels, torch.Tensor) else None


class MicroBatching:
    """The micro-batch size of one trainer: fixed (``setting`` an int) or found (``"auto"``), the auto size
    remembered in ``path`` (a JSON file in the run folder) so that a restart or a resume does not search again."""

    def __init__(self, setting: int | str, path: str | Path | None = None) -> None:
        if setting != "auto" and (not isinstance(setting, int) or setting < 1):
            raise ValueError(f"micro_batch={setting!r}: use None, 'auto' or a number of samples >= 1.")
        self.auto = setting == "auto"
        self.path = Path(path) if path is not None else None
        # None: the whole batch (auto, no OOM yet)
        self.size: int | None = None if self.auto else int(setting)
        self.stable = 0  # auto: successful iterations since the size last changed
        if self.auto and self.path is not None and self.path.is_file():
            self.size = remembered_size(self.path)
            if self.size is not None:
                logger.info("micro_batch auto: %d samples, as remembered in %s", self.size, self.path)

    def current(self, n: int) -> int:
        """The part size for a batch of ``n`` samples."""
        return n if self.size is None else min(self.size, n)

    def parts(self, n: int) -> int:
        """How many parts a batch of ``n`` samples is split into."""
        return -(-n // self.current(n))

    def shrink(self, size: int, n: int, write: bool) -> None:
        """Use ``size`` from now on (logged once per change), written to ``path`` when ``write``."""
        self.size, self.stable = size, 0
        logger.info("micro_batch auto: out of memory; now %d of the %d samples per process at a time", size, n)
        if write and self.path is not None:
            remember(self.path, size)


def remembered_size(path: Path) -> int | None:
    """The size in a ``remember``'ed file, or None when the file is unreadable (a new search then)."""
    try:
        size = json.loads(path.read_text())["micro_batch"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return size if isinstance(size, int) and size >= 1 else None


def remember(path: Path, size: int) -> None:
    """Write ``size`` atomically (a temporary file per process, renamed): any rank may write it; the smallest
    size written so far wins, so ranks that ran out of memory at once agree."""
    before = remembered_size(path) if path.is_file() else None
    if before is not None and before <= size:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"micro_batch": size}) + "\n")
    os.replace(tmp, path)


def in_parts(
    forward: Callable[[Batch], tuple[torch.Tensor, Any]],
    micro_batch: int | MicroBatching,
    model_loss: bool,
    most: Callable[[int], int] | None = None,
) -> Callable[[Batch], tuple[torch.Tensor, Any]]:
    """The evaluator's ``forward`` over parts of the batch: predictions and targets joined along the batch, or (a
    model's own loss) the parts' losses weighted by their samples. ``micro_batch``'s size is read at every batch.
    ``most(n)``: the most samples any rank holds of this batch (a model whose forwards are collectives): every rank
    runs as many parts as that many samples make, the outputs of the parts that pad dropped."""

    def parts(batch: Batch) -> tuple[torch.Tensor, Any]:
        n = batches.size(batch)
        size = micro_batch if isinstance(micro_batch, int) else micro_batch.current(n)
        count = _count(micro_batch, most(n)) if most is not None else 1
        if size >= n and count == 1:
            return forward(batch)
        split = padded(split_batch(batch, n, size), batch, n, count, empty=False)
        ran = [(forward(part), k) for part, k in split]
        outputs = [out for out, k in ran if k]
        if model_loss:
            return torch.stack([loss * k for loss, k in outputs]).sum() / n, n
        return torch.cat([p for p, _ in outputs]), _join([t for _, t in outputs])

    return parts


def _count(micro_batch: int | MicroBatching, n: int) -> int:
    """How many parts a batch of ``n`` samples is split into."""
    return -(-n // micro_batch) if isinstance(micro_batch, int) else micro_batch.parts(n)


def _join(targets: list[Any]) -> Any:
    if isinstance(targets[0], torch.Tensor):
        return torch.cat(targets)
    if isinstance(targets[0], Mapping):
        return {k: _join([t[k] for t in targets]) for k in targets[0]}
    return targets[0]
