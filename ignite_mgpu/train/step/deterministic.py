"""Bitwise-reproducible training (``train.deterministic``): PyTorch's deterministic mode, and ignite's
``DeterministicEngine`` with its RNG states saved as tensors, so that its checkpoints load with plain
``torch.load(path, weights_only=True)``."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from ignite.engine import DeterministicEngine, Engine, Events


def use_deterministic_algorithms() -> None:
    """PyTorch's deterministic mode, strict: an operation without a deterministic kernel raises instead of warning.

    cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` for determinism and reads it when it starts (at the first matmul on
    the GPU): set here unless the user chose a value. ignite's ``DeterministicEngine`` switches the mode to
    ``warn_only`` when a run starts on CUDA; ``PortableDeterministicEngine`` switches it back.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def plain_rng_states(states: list[Any]) -> list[Any]:
    """ignite's ``DeterministicEngine`` RNG states ``[random, torch, numpy]`` with numpy's key array as a tensor,
    so that the checkpoint loads with plain ``torch.load(path, weights_only=True)`` (no numpy globals allowed)."""
    if len(states) > 2 and type(states[2][1]).__module__ == "numpy":
        name, keys, *rest = states[2]
        states = [*states[:2], (name, torch.from_numpy(keys.astype("int64")), *rest)]
    return states


def native_rng_states(states: list[Any]) -> list[Any]:
    """The inverse of ``plain_rng_states``; numpy's own form (older checkpoints) passes through unchanged."""
    if len(states) > 2 and isinstance(states[2][1], torch.Tensor):
        import numpy as np

        name, keys, *rest = states[2]
        # .cpu(): a state read onto a GPU by the caller's own map_location (load_checkpoint reads onto the CPU)
        states = [*states[:2], (name, keys.cpu().numpy().astype(np.uint32), *rest)]
    return states


class PortableDeterministicEngine(DeterministicEngine):
    """ignite's ``DeterministicEngine`` whose ``state_dict`` holds its RNG states as tensors and plain Python values:
    a checkpoint of it loads with plain ``torch.load(path, weights_only=True)``, with no numpy globals allowed.
    State dicts in ignite's own form (numpy arrays) still load."""

    def __init__(self, process_function: Callable[[Engine, Any], Any]) -> None:
        super().__init__(process_function)
        # ignite's own STARTED handler, registered first, sets warn_only on CUDA; this one, run next, undoes it.
        self.add_event_handler(Events.STARTED, use_deterministic_algorithms)

    def state_dict(self) -> OrderedDict:
        state = super().state_dict()
        state["rng_states"] = plain_rng_states(state["rng_states"])
        return state

    def load_state_dict(self, state_dict: Mapping) -> None:
        state = dict(state_dict)
        if state.get("rng_states") is not None:
            state["rng_states"] = native_rng_states(list(state["rng_states"]))
        super().load_state_dict(state)
