"""What a batch is and what a model returns, for every loss kind: a batch is a sequence ``(inputs, targets, *extra)``
or a mapping (Hugging Face style, targets under "labels" or "targets"); a model returns predictions (a tensor,
or ``logits`` in a mapping or attribute) or its own loss (a tensor, ``"loss"`` in a mapping, or a ``.loss``).
Torch only: the launching process checks a dataset's first batch with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ignite_mgpu.errors import ConfigError

Batch = Any  # a sequence (inputs, targets, *extra) or a mapping, of tensors and other values
# Where a mapping batch holds its targets (Hugging Face names them "labels")
TARGET_KEYS = ("labels", "targets")


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of ``batch`` on ``device``, nested mappings and sequences included; anything else as it is.

    Runs once per iteration, so the common cases come first and cost little: a tensor already on ``device`` (every
    CPU batch) is kept without calling ``.to`` (whose argument parsing costs more than the move it skips), a plain
    list or tuple is rebuilt without asking for namedtuple ``_fields`` (a failing ``hasattr`` raises and catches an
    exception), and the ``Mapping`` ABC, the slowest test, comes last.
    """
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=non_blocking)
    # Tensors on the device are kept here, without a call per entry.
    if isinstance(batch, (list, tuple)):
        moved = [
            v if isinstance(v, torch.Tensor) and v.device == device else to_device(v, device, non_blocking)
            for v in batch
        ]
        kind = type(batch)
        if kind is list or kind is tuple:
            return moved if kind is list else tuple(moved)
        return kind(*moved) if hasattr(batch, "_fields") else kind(moved)  # namedtuples too
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def tensors(data: Any) -> list[torch.Tensor]:
    """The tensors in ``data``: a tensor, or those in its mappings (a model's output too), lists and tuples, at any
    depth."""
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        return [t for item in data for t in tensors(item)]
    return []


def split(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets): a sequence's first two entries, or a mapping's targets and its other entries (keyword
    arguments of the model)."""
    if isinstance(batch, Mapping):
        key = next((k for k in TARGET_KEYS if k in batch), None)
        if key is None:
            raise TypeError(
                f"a loss function needs the batch's targets, but this mapping batch has no {' or '.join(TARGET_KEYS)} "
                f"(its keys: {', '.join(map(str, batch))}). Add the targets to the dataset's items, or let the model "
                "compute its own loss (train.loss=model; create_trainer(loss_fn=None))."
            )
        return {k: v for k, v in batch.items() if k != key}, batch[key]
    return batch[0], batch[1]


def labels(batch: Any) -> torch.Tensor:
    """A batch's targets: a mapping's ``labels`` or ``targets``, a sequence's second entry; TypeError else."""
    found = next((batch[k] for k in TARGET_KEYS if k in batch), None) if isinstance(batch, Mapping) else None
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        found = batch[1]
    if not isinstance(found, torch.Tensor):
        raise TypeError(
            f"the batch holds no labels tensor ({' or '.join(TARGET_KEYS)} of a mapping, the second entry of a "
            f"sequence), which perplexity counts the tokens of; its type: {type(batch).__name__}."
        )
    return found


def predict(model: nn.Module, inputs: Any) -> Any:
    """The model's output for ``inputs``: ``model(**inputs)`` for a mapping, else ``model(inputs)``."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def logits(output: Any) -> torch.Tensor:
    """The predictions in a model's output: the tensor itself, or its ``logits`` (mapping key or attribute)."""
    return _entry(
        output,
        "logits",
        f"the model returned a {type(output).__name__}; with a loss function it must return the predictions: a "
        "tensor, or an object or mapping with a 'logits' tensor.",
    )


def model_loss(model: nn.Module, batch: Any) -> Any:
    """What a model that computes its own loss returns: ``model(**batch)`` for a mapping, ``model(x, y)`` else."""
    return model(**batch) if isinstance(batch, Mapping) else model(batch[0], batch[1])


def loss_of(output: Any) -> torch.Tensor:
    """The loss in the output of a model that computes it: the tensor, ``output["loss"]`` or ``output.loss``."""
    return _entry(
        output,
        "loss",
        f"the model computes its own loss (loss_fn=None, train.loss=model) but returned a {type(output).__name__} "
        "without one: return the loss tensor, or an object or mapping with a 'loss'.",
    )


def _entry(output: Any, name: str, error: str) -> torch.Tensor:
    """``output`` itself when it is a tensor, else its tensor ``name`` (mapping key or attribute); TypeError else."""
    if isinstance(output, torch.Tensor):
        return output
    found = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
    if not isinstance(found, torch.Tensor):
        raise TypeError(error)
    return found


def size(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        if (n := size(value)) >= 0:
            return n
    return -1


def check(batch: Any, loss: str) -> None:
    """ConfigError when a batch cannot feed ``train.loss``: a mapping without targets for a loss function, a
    sequence without (inputs, targets), or no tensor at all. ``batch`` is one collated batch of the dataset."""
    if size(batch) < 0:
        raise ConfigError(f"a batch of the dataset holds no tensor ({type(batch).__name__}); check data.name's items.")
    if isinstance(batch, Mapping):
        if loss != "model" and not any(k in batch for k in TARGET_KEYS):
            raise ConfigError(
                f"train.loss={loss} needs the targets, but the dataset's batches are mappings without "
                f"{' or '.join(TARGET_KEYS)} (keys: {', '.join(map(str, batch))}). Add them to the items, or use "
                "train.loss=model if the model computes its own loss from the batch."
            )
    elif not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise ConfigError(
            f"the dataset's batches are a {type(batch).__name__}, but train.loss={loss} needs (inputs, targets) "
            "pairs or a mapping. Return (input, target) pairs or dicts from the dataset's __getitem__."
        )
