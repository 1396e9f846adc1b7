"""Writing a model's weights as safetensors (no pickle: a JSON header and raw tensors, read by Hugging Face, timm
and Accelerate alike): each tie (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) written once and named
in the metadata, the file written atomically. ``files.read_safetensors`` reads it back, each tie one tensor again.

Imports torch, never ignite: ``checkpoint convert`` runs in the launching process.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ignite_mgpu.checkpoint.files import SAFETENSORS, TEMP_PREFIX, TIED, fsync_dir
from ignite_mgpu.errors import CheckpointError

SOURCE = "ignite_mgpu.source"  # metadata: what the weights were written from
# The run's settings that rebuild its model.
MODEL_KEYS = ("model.name", "model.num_classes", "model.args.")


def tie_groups(module: nn.Module) -> list[list[str]]:
    """The names under which one parameter or buffer appears in ``module.state_dict()``, for each tensor that has
    several (tied weights), in the module's order: the first is the owner (``transformer.wte.weight``)."""
    names: dict[int, list[str]] = {}
    params, buffers = module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    for name, tensor in itertools.chain(params, buffers):
        names.setdefault(id(tensor), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(state: Mapping[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """``state`` with each group's tensors one tensor again (a sharded model's gathered state holds a copy per
    name); a tensor of another shape or dtype is left as it is."""
    state = dict(state)
    for group in groups:
        present = [name for name in group if name in state]
        for name in present[1:]:
            owner, copy = state[present[0]], state[name]
            if copy.shape == owner.shape and copy.dtype == owner.dtype:
                state[name] = owner
    return state


class TiedWeights:
    """What ``checkpoint.best_format=safetensors`` saves: ``model``'s state_dict (``model``: the unwrapped module or
    its gathered state, ``state.FullModelState``) with each tie of ``module`` one tensor, so it is written once."""

    def __init__(self, model: Any, module: nn.Module) -> None:
        self.model, self.groups = model, tie_groups(module)

    def state_dict(self) -> dict[str, Any]:
        return retie(self.model.state_dict(), self.groups)


def model_metadata(config: Mapping[str, str]) -> dict[str, str]:
    """The settings of a run signature (``run.config`` of a checkpoint) that rebuild its model, as metadata."""
    return {f"ignite_mgpu.{k}": str(v) for k, v in config.items() if k.startswith(MODEL_KEYS)}


def tensors_to_write(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors a safetensors file holds (each tensor once, a compact copy where it shares its storage with
    another one, on the CPU) and the ties ({name not written: the name written in its place})."""
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    written: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[Any, ...]] = set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"{name} is a {type(tensor).__name__}, not a tensor: a safetensors file holds tensors only. Keep "
                "this model's weights as .pt (checkpoint.best_format=pt, or convert into a .pt file)."
            )
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        view = (*storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if tensor.numel() and view in written:  # the same tensor under another name: a tie
            tied[name] = written[view]
            continue
        written[view] = name
        whole = tensor.is_contiguous() and tensor.nbytes == tensor.untyped_storage().nbytes()
        if storage in storages or not whole:  # a slice or another view of a storage: its own copy
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        storages.add(storage)
        tensors[name] = tensor.cpu()
    return tensors, tied


def write_safetensors(state: Mapping[str, Any], path: str | Path, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``state``'s tensors into ``path``: each tie once (listed under ``ignite_mgpu.tied``), ``format: pt``
    (what Hugging Face's ``from_pretrained`` expects) and ``metadata``; through a temp file in the same folder,
    fsynced and renamed, so ``path`` is either the old file or the whole new one. Created 0600."""
    from safetensors.torch import save_file

    from ignite_mgpu import __version__

    tensors, tied = tensors_to_write(state)
    meta = {"format": "pt", "ignite_mgpu.version": __version__, **(metadata or {})}
    if tied:
        meta[TIED] = json.dumps(tied, sort_keys=True)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=SAFETENSORS)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, 0o600)  # weights are the user's: private, as every checkpoint file is
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # the rename survives a power loss only once its folder is synced


def save_weights(
    model: nn.Module | Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> None:
    """Write a model's weights (or a state_dict) as a ``.safetensors`` file that shares well: no wrapper prefix,
    tied parameters written once and restored tied by ``load_checkpoint``, ``metadata`` (str -> str) added.

    A model sharded by FSDP is gathered first: every rank must call it, and rank 0 writes.

    Raises:
        CheckpointError: a value is not a tensor, or the file cannot be written.
    """
    from safetensors import SafetensorError

    from ignite_mgpu.checkpoint.files import strip_prefixes

    if isinstance(model, nn.Module):
        from ignite_mgpu.checkpoint.state import FullModelState
        from ignite_mgpu.parallel.fsdp import find_fsdp
        from ignite_mgpu.parallel.strategy import unwrap

        fsdp = find_fsdp(model)
        module = cast(nn.Module, fsdp) if fsdp is not None else unwrap(model)
        state = TiedWeights(FullModelState(module) if fsdp is not None else module, module).state_dict()
        if fsdp is not None and not state:
            return  # not rank 0: its shards were gathered onto rank 0, which writes
    else:
        state = strip_prefixes(model)[0]
    try:
        write_safetensors(state, path, metadata)
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"cannot write {path} ({err}).") from err
