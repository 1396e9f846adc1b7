"""Checkpoint files: safe tolerant loading, resume discovery, and the ``checkpoint inspect`` / ``convert`` helpers.

Imports torch but not ignite: the launching process checks the output folder with it before it spawns the workers,
and importing ignite there would delay every start by about a second. The saver and the ignite ``Checkpoint``
handlers that write the files are in handlers.py.
"""

from __future__ import annotations

import logging
import os
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ignite_mgpu.models import unwrap

if TYPE_CHECKING:
    from ignite.handlers import Checkpoint

logger = logging.getLogger(__name__)
PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP and torch.compile wrappers
_CKPT_NAME = re.compile(r"^checkpoint_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, unsafe, or from a different model."""


def _allow_rng_state_types() -> None:
    # DeterministicEngine saves numpy's RNG state; weights_only refuses numpy unless these exact types are allowed.
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]  # numpy 1 location
    allowed: list[Any] = [np.ndarray, np.dtype, _reconstruct]
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64")]
    torch.serialization.add_safe_globals(allowed)


_allow_rng_state_types()


def clean_stale_temp_files(dirname: str | Path) -> None:
    """Remove temp files a killed writer left behind (only ours: ``.tmp-*.pt``)."""
    for tmp in Path(dirname).glob(".tmp-*.pt"):
        tmp.unlink(missing_ok=True)


def is_complete(path: Path) -> bool:
    """True when ``path`` is a whole torch zip archive whose every record passes its CRC check."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError):
        return False


def list_checkpoints(dirname: str | Path) -> list[Path]:
    """``checkpoint_<iteration>.pt`` files, newest (highest iteration) first; by recorded step, never mtime."""
    found = [(int(m.group(1)), p) for p in Path(dirname).glob("checkpoint_*.pt") if (m := _CKPT_NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def find_resumable(dirname: str | Path) -> Path | None:
    """The newest complete checkpoint; a truncated/corrupt newer one is skipped with a warning."""
    for path in list_checkpoints(dirname):
        if is_complete(path):
            return path
        logger.warning("skipping %s: corrupt or truncated (incomplete zip archive); trying the previous one", path)
    return None


def read_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """``torch.load(..., weights_only=True)`` with errors that say what is wrong. Never runs pickled code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; pass the path of a .pt file.")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        text = str(err)
        if "Weights only load failed" in text or "Unsupported global" in text:
            first = next((ln for ln in text.splitlines() if "Unsupported global" in ln), text.splitlines()[0])
            raise CheckpointError(
                f"refusing to load {path}: it needs arbitrary Python code to unpickle ({first.strip()}). It was "
                "NOT executed. Only load files you trust; re-save trusted weights as a plain state_dict."
            ) from None
        raise CheckpointError(
            f"{path} is corrupt or truncated and cannot be loaded ({text.splitlines()[0]})."
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state_dict or a checkpoint dict.")
    return obj


def strip_prefixes(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Remove wrapper prefixes that every key carries (``module.``, ``_orig_mod.``); returns (clean, found)."""
    clean, found = dict(state_dict), []
    changed = True
    while changed and clean:
        changed = False
        for prefix in PREFIXES:
            if all(k.startswith(prefix) for k in clean):
                clean = {k[len(prefix) :]: v for k, v in clean.items()}
                found.append(prefix)
                changed = True
    return clean, found


def is_state_dict(obj: Mapping[str, Any]) -> bool:
    return bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


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


def load_checkpoint(
    path: str | Path,
    to_load: Mapping[str, Any],
    map_location: Any = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load ``path`` into the objects of ``to_load`` (e.g. ``{"model": model, "optimizer": opt}``).

    Accepts a full checkpoint or a bare state_dict (for the model), strips ``module.`` / ``_orig_mod.``, maps every
    tensor to this rank's device (not cuda:0 for all ranks), and loads with ``weights_only=True``.
    Everything is checked before anything is loaded, so a mismatch leaves the objects untouched; ``check``
    (called with the checkpoint dict) can add a test of its own.

    Returns:
        The checkpoint dict as read (after prefix stripping of its model entry).
    """
    if map_location is None:
        import ignite.distributed as idist

        map_location = idist.device()
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
        model = to_load["model"]
        check_model_state(unwrap(model), ckpt["model"], str(path))
    if check is not None:
        check(ckpt)
    for name, obj in to_load.items():
        target = unwrap(obj) if isinstance(obj, nn.Module) else obj
        target.load_state_dict(ckpt[name])
    return ckpt


def describe(path: str | Path) -> dict[str, Any]:
    """What ``checkpoint inspect`` prints: entries, step, parameter count, dtypes, wrapper prefixes."""
    ckpt = read_checkpoint(path)
    bare = is_state_dict(ckpt)
    model_state = ckpt if bare else ckpt.get("model", {})
    _, prefixes = strip_prefixes(model_state) if model_state else ({}, [])
    info: dict[str, Any] = {
        "path": str(path),
        "kind": "state_dict" if bare else "checkpoint",
        "entries": sorted(ckpt) if not bare else [],
        "tensors": len(model_state),
        "parameters": int(sum(v.numel() for v in model_state.values() if isinstance(v, torch.Tensor))),
        "dtypes": sorted({str(v.dtype).replace("torch.", "") for v in model_state.values() if hasattr(v, "dtype")}),
        "prefixes": prefixes,
        "first_keys": list(model_state)[:5],
    }
    trainer = ckpt.get("trainer") if not bare else None
    if isinstance(trainer, Mapping):
        info.update({k: trainer[k] for k in ("iteration", "epoch", "epoch_length", "max_epochs") if k in trainer})
    if isinstance(ckpt.get("run"), Mapping):
        info["run"] = dict(ckpt["run"])
    return info


def convert(src: str | Path, dst: str | Path) -> list[str]:
    """Write a clean, unwrapped model state_dict from a legacy (``module.``-prefixed) file or a full checkpoint."""
    ckpt = read_checkpoint(src)
    state = ckpt if is_state_dict(ckpt) else ckpt.get("model")
    if not isinstance(state, Mapping) or not state:
        raise CheckpointError(f"{src} has no model state_dict to convert (entries: {', '.join(ckpt)}).")
    clean, found = strip_prefixes(state)
    torch.save(clean, dst)
    os.chmod(dst, 0o600)
    return found


class RunInfo:
    """Saved with every checkpoint: what a resume must know about the run that wrote it."""

    def __init__(self, world_size: int, global_batch: int, config: dict[str, str]) -> None:
        self.info = {"world_size": world_size, "global_batch": global_batch, "config": config}
        self.loaded: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.info)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = dict(state)


_BEST_NAME = re.compile(r"^best_model_(\d+)_val_\w+=(-?[\d.]+)\.pt$")


def adopt_existing(full: Checkpoint, best: Checkpoint, dirname: str | Path) -> None:
    """On resume, let the handlers manage the files the interrupted run left (keep n_saved, one best)."""
    found = [(int(m.group(1)), p.name) for p in list_checkpoints(dirname) if (m := _CKPT_NAME.match(p.name))]
    full.load_state_dict({"_saved": sorted(found)})
    bests = [
        (float(m.group(2)), p.name)  # the file name already holds the signed score
        for p in Path(dirname).glob("best_model_*.pt")
        if (m := _BEST_NAME.match(p.name))
    ]
    best.load_state_dict({"_saved": sorted(bests)})
