"""Loading a checkpoint (full or a bare state_dict) into live objects: every key and shape checked before anything is
loaded, wrapper prefixes stripped, read onto the CPU (each ``load_state_dict`` places its own tensors)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ignite_mgpu.checkpoint.files import is_safetensors, is_state_dict, read_checkpoint, strip_prefixes
from ignite_mgpu.checkpoint.weights import tie_groups
from ignite_mgpu.errors import CheckpointError
from ignite_mgpu.parallel.strategy import unwrap

logger = logging.getLogger(__name__)


def check_model_state(model: nn.Module, state: Mapping[str, Any], source: str) -> None:
    """Raise CheckpointError listing the first missing / unexpected / mis-shaped keys (nothing is loaded)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and hasattr(state[k], "shape") and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:

        def few(items: list[str]) -> str:
            return ", ".join(items[:5]) + (f" (+{len(items) - 5} more)" if len(items) > 5 else "")

        parts = [
            f"{len(x)} {what}: {few(x)}"
            for what, x in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes))
            if x
        ]
        raise CheckpointError(
            f"{source} does not match the model ({'; '.join(parts)}). "
            "Is it from a different model.name or model.num_classes?"
        )


def with_ties_of(module: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with each name that ``module`` ties to a name present filled in (the file wrote the tensor once)."""
    state = dict(state)
    for group in tie_groups(module):
        present = [name for name in group if name in state]
        state.update({name: state[present[0]] for name in group if present and name not in state})
    return state


def load_checkpoint(
    path: str | Path,
    to_load: Mapping[str, Any],
    map_location: Any = "cpu",
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load ``path`` into the objects of ``to_load`` (e.g. ``{"model": model, "optimizer": opt}``).

    Accepts a full checkpoint, a bare state_dict or a ``.safetensors`` file (for the model: a name the model ties
    to another one may be left out, as Hugging Face writes them), strips ``module.`` / ``_orig_mod.`` and loads with
    ``weights_only=True``. Tensors are read onto the CPU (``map_location``) and each ``load_state_dict`` places its
    own: a model copies into its parameters, an optimizer moves its state to its parameters' device but keeps a
    non-capturable ``step`` on the CPU (on a GPU, Adam would read it back with a sync per parameter per step), and
    RNG states stay the CPU tensors their setters take.
    Everything is checked before anything is loaded, so a mismatch leaves the objects untouched; ``check``
    (called with the checkpoint dict) can add a test of its own.

    Returns:
        The checkpoint dict as read (after prefix stripping of its model entry).
    """
    ckpt = read_checkpoint(path, map_location)
    if is_state_dict(ckpt) or "model" not in ckpt:
        ckpt = {"model": ckpt}
    absent = [k for k in to_load if k not in ckpt]
    if absent:
        raise CheckpointError(
            f"{path} has no {', '.join(absent)} (it holds: {', '.join(ckpt)}); "
            "a weights-only file can restore the model but not resume training."
        )
    if "model" in to_load:
        ckpt["model"], found = strip_prefixes(ckpt["model"])
        if found:
            logger.info("%s: stripped the %s prefix from every key", path, " and ".join(found))
        module = unwrap(to_load["model"])
        if is_safetensors(path):
            ckpt["model"] = with_ties_of(module, ckpt["model"])
        check_model_state(module, ckpt["model"], str(path))
    if check is not None:
        check(ckpt)
    for name, obj in to_load.items():
        target = unwrap(obj) if isinstance(obj, nn.Module) else obj
        target.load_state_dict(ckpt[name])
    return ckpt
