"""What ``ignite-mgpu checkpoint inspect`` shows and ``checkpoint convert`` writes, for a checkpoint file, a bare
state_dict or a sharded folder alike. Runs in the launching process: torch, never ignite."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ignite_mgpu.checkpoint.files import (
    SAFETENSORS,
    TIED,
    TRAIN_STATE,
    is_safetensors,
    is_state_dict,
    read_checkpoint,
    read_safetensors,
    strip_prefixes,
)
from ignite_mgpu.checkpoint.sharded import SHARDED, model_shapes, no_dist, single_process_quietly
from ignite_mgpu.checkpoint.weights import SOURCE, model_metadata, write_safetensors
from ignite_mgpu.errors import CheckpointError

TRAINER_KEYS = ("iteration", "epoch", "epoch_length", "max_epochs")


def describe(path: str | Path) -> dict[str, Any]:
    """What ``checkpoint inspect`` prints: entries, step, parameter count, dtypes, wrapper prefixes (of a file or a
    sharded folder, which also counts its shard files; of a safetensors file, its metadata and ties)."""
    if Path(path).is_file() and is_safetensors(path):
        weights, metadata = read_safetensors(Path(path))
        info = _summary(path, "safetensors", [], weights, strip_prefixes(weights)[1], {})
        info["tied"] = json.loads(metadata.pop(TIED, "{}"))
        return info | {"metadata": dict(sorted(metadata.items()))}
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
    """Write a clean, unwrapped model state_dict from a legacy (``module.``-prefixed) file, a full checkpoint, a
    safetensors file, or a sharded checkpoint folder (its shards gathered in this process, without a process
    group): a ``.safetensors`` ``dst`` with each tie once and the run's model settings as metadata, else a
    ``torch.save`` file. Returns the prefixes stripped."""
    from safetensors import SafetensorError

    clean, found, metadata = _model_of(Path(src))
    if Path(dst).suffix != SAFETENSORS:
        _write(clean, dst)
        return found
    try:
        write_safetensors(clean, dst, metadata)
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"cannot write {dst} ({err}).") from err
    return found


def _model_of(src: Path) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """``src``'s model state_dict without prefixes, the prefixes stripped, and the metadata a safetensors file of it
    gets: its source's name, the run's model settings (or a safetensors source's own metadata)."""
    carried: dict[str, str] = {}
    found: list[str] = []
    if src.is_dir():
        clean = _gathered_model(src)
        state = read_checkpoint(src / TRAIN_STATE) if (src / TRAIN_STATE).is_file() else {}
    else:
        if src.is_file() and is_safetensors(src):
            ckpt, carried = read_safetensors(src)  # its ties are found again from the tensors
        else:
            ckpt = read_checkpoint(src)
        model = ckpt if is_state_dict(ckpt) else ckpt.get("model")
        if not isinstance(model, Mapping) or not model:
            raise CheckpointError(f"{src} has no model state_dict to convert (entries: {', '.join(ckpt)}).")
        (clean, found), state = strip_prefixes(model), ({} if model is ckpt else ckpt)
    run = state.get("run")
    config = run.get("config") if isinstance(run, Mapping) else None
    metadata = {k: v for k, v in carried.items() if k != TIED} | {SOURCE: src.name}
    return clean, found, metadata | model_metadata(config if isinstance(config, Mapping) else {})


def _gathered_model(folder: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    model = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in model_shapes(folder).items()}
    if not model:
        raise CheckpointError(f"{folder} holds no model tensors to convert.")
    with single_process_quietly():
        dcp.load({"model": model}, checkpoint_id=str(folder), **no_dist(True))
    return model


def _write(state_dict: Mapping[str, torch.Tensor], dst: str | Path) -> None:
    torch.save(dict(state_dict), dst)
    os.chmod(dst, 0o600)  # weights are the user's: private, as every checkpoint file is
