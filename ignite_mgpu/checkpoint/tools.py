"""What ``ignite-mgpu checkpoint inspect`` shows and ``checkpoint convert`` writes, for a checkpoint file, a bare
state_dict or a sharded folder alike. Runs in the launching process: torch, never ignite."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ignite_mgpu.checkpoint.files import TRAIN_STATE, is_state_dict, read_checkpoint, strip_prefixes
from ignite_mgpu.checkpoint.sharded import SHARDED, model_shapes, single_process_quietly
from ignite_mgpu.errors import CheckpointError

TRAINER_KEYS = ("iteration", "epoch", "epoch_length", "max_epochs")


def describe(path: str | Path) -> dict[str, Any]:
    """What ``checkpoint inspect`` prints: entries, step, parameter count, dtypes, wrapper prefixes (of a file or a
    sharded folder, which also counts its shard files)."""
    if Path(path).is_dir():
        shapes = model_shapes(Path(path))  # first: an incomplete folder is named as such
        state = read_checkpoint(Path(path) / TRAIN_STATE)
        info = _summary(path, "sharded checkpoint", sorted([*SHARDED, *state]), shapes, [], state)
        info["shard_files"] = len(list(Path(path).glob("*.distcp")))
        return info
    ckpt = read_checkpoint(path)
    if is_state_dict(ckpt):
        return _summary(path, "state_dict", [], ckpt, strip_prefixes(ckpt)[1], {})
    model_state = ckpt.get("model", {})
    prefixes = strip_prefixes(model_state)[1] if model_state else []
    return _summary(path, "checkpoint", sorted(ckpt), model_state, prefixes, ckpt)


def _summary(
    path: str | Path,
    kind: str,
    entries: list[str],
    model_state: Mapping[str, Any],
    prefixes: list[str],
    state: Mapping[str, Any],
) -> dict[str, Any]:
    """One description for every kind: the model's tensors, and the trainer's step and the run's info in ``state``."""
    tensors = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    info: dict[str, Any] = {
        "path": str(path),
        "kind": kind,
        "entries": entries,
        "tensors": len(model_state),
        "parameters": int(sum(math.prod(t.shape) for t in tensors.values())),
        "dtypes": sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()}),
        "prefixes": prefixes,
        "first_keys": list(model_state)[:5],
    }
    trainer = state.get("trainer")
    if isinstance(trainer, Mapping):
        info.update({k: trainer[k] for k in TRAINER_KEYS if k in trainer})
    if isinstance(state.get("run"), Mapping):
        info["run"] = dict(state["run"])
    return info


def convert(src: str | Path, dst: str | Path) -> list[str]:
    """Write a clean, unwrapped model state_dict from a legacy (``module.``-prefixed) file, a full checkpoint, or a
    sharded checkpoint folder (its shards gathered in this process, without a process group). Returns the
    prefixes stripped."""
    if Path(src).is_dir():
        _write(_gathered_model(Path(src)), dst)
        return []
    ckpt = read_checkpoint(src)
    state = ckpt if is_state_dict(ckpt) else ckpt.get("model")
    if not isinstance(state, Mapping) or not state:
        raise CheckpointError(f"{src} has no model state_dict to convert (entries: {', '.join(ckpt)}).")
    clean, found = strip_prefixes(state)
    _write(clean, dst)
    return found


def _gathered_model(folder: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    model = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in model_shapes(folder).items()}
    if not model:
        raise CheckpointError(f"{folder} holds no model tensors to convert.")
    with single_process_quietly():
        dcp.load({"model": model}, checkpoint_id=str(folder), no_dist=True)
    return model


def _write(state_dict: Mapping[str, torch.Tensor], dst: str | Path) -> None:
    torch.save(dict(state_dict), dst)
    os.chmod(dst, 0o600)  # weights are the user's: private, as every checkpoint file is
