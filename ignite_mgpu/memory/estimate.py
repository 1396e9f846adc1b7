"""One training step measured on fake tensors (``FakeTensorMode``: shapes and dtypes, no storage): the bytes a
process holds for parameters, gradients, optimizer state and activations, and its peak, under a strategy and a
process count. PyTorch's own trackers do the counting (``torch.distributed._tools``: ``MemTracker`` watches every
storage a dispatched op creates or frees, ``FSDPMemTracker`` also FSDP2's sharded and gathered parameters); what this
module adds is the project's step (model, first batch, loss, optimizer, precision) and what the trackers cannot see
(DDP's gradient buckets). ``budget.py`` turns the figures into a plan.

PyTorch has no public fake-tensor mode or memory tracker: ``FakeTensorMode`` (``torch._subclasses``), the trackers
and their ``_update_peak_stats`` are private, guarded by ``tests/test_private_apis.py`` (CONTRIBUTING.md lists why)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

# Its import registers the "fake" backend (``_fake_group``): PyTorch 2.14's still does.
import torch.distributed.fsdp
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

from ignite_mgpu.config.schema import Config
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train.data import batches
from ignite_mgpu.train.data.datasets import build_datasets, first_batch
from ignite_mgpu.train.losses import create_loss
from ignite_mgpu.train.models import create_model

# The first step creates the optimizer state; the second runs its backward with that state held.
STEPS = 2
# On CUDA, what fake tensors never show but PyTorch's allocator counts: a cuBLAS workspace per handle and stream (32
# MiB on Hopper and newer, PyTorch's default; less before), one for the step's thread and one for autograd's.
CUBLAS_WORKSPACES = 2 * 32 * 2**20


class _PeakOnly:
    """The trackers' global peak without their per-module peaks, which walk every module at every op (seven times
    slower on a 12-layer GPT-2); the step needs the process's peak only. It overrides a private method that the
    trackers call after every op (no public switch turns the per-module peaks off)."""

    _curr_mem_snap: dict[torch.device, dict[str, int]]
    _peak_mem: dict[torch.device, int]
    _peak_mem_snap: dict[torch.device, dict[str, int]]

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap["Total"]:
                self._peak_mem[device] = snap["Total"]
                self._peak_mem_snap[device] = dict(snap)


class StepTracker(_PeakOnly, MemTracker):
    """``MemTracker``, global peak only."""


class ShardedStepTracker(_PeakOnly, FSDPMemTracker):
    """``FSDPMemTracker``, global peak only."""


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What one process holds at its peak of a training step, in bytes (``block``: FSDP's largest gathered unit)."""

    batch: int  # samples this process computes at once
    params: int
    grads: int
    optimizer: int
    activations: int  # activations and backward temporaries at the peak
    inputs: int  # the batch itself
    buckets: int  # DDP's gradient buckets (a copy of every gradient, kept from construction on)
    # The most held at once during the step: params + grads + state + activations + inputs + buckets (+ workspaces).
    peak: int
    block: int = 0  # fsdp: the largest unit's unsharded parameters (in the compute dtype)
    outputs: int = 0  # the model's predictions for the batch (DataParallel gathers them on GPU 0)
    workspaces: int = 0  # on CUDA: cuBLAS's workspaces (in peak)


def fake_batch(example: Any, size: int) -> Any:
    """``example`` (a collated batch) with every tensor's first dimension set to ``size``, as fake tensors."""
    if isinstance(example, torch.Tensor):
        shape = (size, *example.shape[1:]) if example.dim() else example.shape
        return torch.zeros(shape, dtype=example.dtype)
    if isinstance(example, Mapping):
        return {k: fake_batch(v, size) for k, v in example.items()}
    if isinstance(example, (list, tuple)):
        return type(example)(fake_batch(v, size) for v in example)
    return example


def example_batch(cfg: Config) -> Any:
    """The dataset's first two samples, collated as the loaders do (real tensors: only their shapes are used)."""
    splits = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
    return first_batch(splits.train, splits.collate_fn, 2)


def _loss_of(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, batch: Any) -> tuple[torch.Tensor, int]:
    """The loss the trainer computes for ``batch`` (``trainer.py``'s step, without DataParallel's per-GPU vector),
    and the bytes of the model's predictions (what DataParallel gathers on GPU 0)."""
    if loss_fn is None:
        out = batches.model_loss(model, batch)
        logits = getattr(out, "logits", None) if not isinstance(out, Mapping) else out.get("logits")
        return batches.loss_of(out), _bytes(iter([logits])) if isinstance(logits, torch.Tensor) else 0
    if isinstance(batch, Mapping):
        inputs, targets = batches.split(batch)
        logits = batches.logits(model(**inputs))
    else:
        out = model(batch[0])
        logits, targets = (out if isinstance(out, torch.Tensor) else batches.logits(out)), batch[1]
    return loss_fn(logits, targets), _bytes(iter([logits]))


def _autocast(precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    from ignite_mgpu.train.optim import create_optimizer, optim_options

    return create_optimizer(model, **optim_options(cfg.optim), distributed=False)


def _run_steps(
    cfg: Config, model: nn.Module, tracker: MemTracker, batch: Any, cuda: bool
) -> tuple[torch.optim.Optimizer, int]:
    """``STEPS`` training steps as the trainer runs them: forward and loss under autocast, backward, clipping,
    optimizer step, gradients set to None. Returns the optimizer and the predictions' bytes."""
    loss_fn = create_loss(cfg.train.loss, cfg.train.loss_args, device="cpu")
    optimizer = _optimizer(cfg, model)
    for group in optimizer.param_groups if cuda else []:
        # On CUDA torch.optim takes its foreach path (fake CPU tensors, the single-tensor one), whose temporaries
        # (AdamW's: about the parameters' size) are part of the peak; a choice the user made stays.
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True
    params = [p for p in model.parameters() if p.requires_grad]
    with tracker:
        for _ in range(STEPS):
            with _autocast(cfg.train.precision):
                loss, outputs = _loss_of(model, loss_fn, batch)
            loss.backward()
            del loss
            if cfg.train.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.train.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()  # the trackers refuse a second forward of a module otherwise
    return optimizer, outputs


def _bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of this process's part of ``tensors`` (a DTensor's local shard: ``to_local``)."""
    with torch.no_grad():  # to_local records no autograd step
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_bytes(v for v in s.values() if isinstance(v, torch.Tensor)) for s in optimizer.state.values())


def measure(
    cfg: Config, example: Any, batch: int, world_size: int = 1, strategy: str = "ddp", cuda: bool = False
) -> Footprint:
    """One process's footprint: ``batch`` samples per step, ``world_size`` processes under ``strategy`` ("ddp":
    each process holds the whole model, plus DDP's buckets when there are several; "fsdp": sharded over
    ``world_size``). The model, loss and optimizer are the configured ones, built on fake tensors; ``cuda``: as
    the step runs on a GPU (the optimizer's foreach path, cuBLAS's workspaces)."""
    sharded = strategy == "fsdp" and world_size > 1
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    lazy = _lazy_model(cfg, example)
    with _fake_group(world_size if sharded else 1) as mesh, mode:
        if lazy is not None:
            model = _on_fake_storage(lazy)
        else:
            model = create_model(cfg.model, _inputs(fake_batch(example, 1)))
        model.train()
        block = shard(cfg, model, mesh) if sharded else 0
        data = fake_batch(example, batch)
        tracker: MemTracker
        if sharded:
            # The optimizer is created inside: its hooks are global.
            tracker = ShardedStepTracker(model, None)
            tracker.track_inputs(data)
        else:
            tracker = StepTracker()
            tracker.track_external(model, *batches.tensors(data))
        optimizer, outputs = _run_steps(cfg, model, tracker, data, cuda)
        found = _footprint(tracker, model, optimizer, batch, block, buckets=strategy == "ddp" and world_size > 1)
        workspaces = CUBLAS_WORKSPACES if cuda else 0
        return dataclasses.replace(found, outputs=outputs, workspaces=workspaces, peak=found.peak + workspaces)


def _lazy_model(cfg: Config, example: Any) -> nn.Module | None:
    """A model with lazy layers (``nn.LazyLinear``), built and materialised on the meta device (no memory): such
    layers cannot make their parameters under the fake mode. None for a model without them (or one that cannot be
    built on the meta device), which is built under the fake mode itself."""
    try:
        with torch.device("meta"):
            model = create_model(cfg.model)
            if not any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
                return None
            return create_model(cfg.model, _inputs(fake_batch(example, 1)))
    except Exception:  # e.g. a factory that reads a tensor's value: the fake mode's own build says what is wrong
        return None


def _on_fake_storage(model: nn.Module) -> nn.Module:
    """The meta model's parameters and buffers made again under the fake mode, as the model's own constructor makes
    them (``nn.Parameter`` of an empty tensor; ``to_empty`` would leave plain tensors, which FSDP treats otherwise);
    a tensor shared by several modules stays one."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad)
            setattr(module, name, made[id(param)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            made.setdefault(id(buffer), torch.empty_like(buffer, device="cpu"))
            setattr(module, name, made[id(buffer)])
    return model


def _footprint(
    tracker: MemTracker, model: nn.Module, optimizer: torch.optim.Optimizer, batch: int, block: int, buckets: bool
) -> Footprint:
    """The tracker's peak snapshot, by kind; the optimizer state and gradients as the step leaves them."""
    peak = {str(k.value if hasattr(k, "value") else k): v for k, v in _one_device(tracker).items()}
    params = _bytes(model.parameters())
    grads = _bytes(p for p in model.parameters() if p.requires_grad)
    extra = grads if buckets else 0
    inputs = peak.get("Inputs", 0) + peak.get("Other", 0)
    activations = peak.get("Activation", 0) + peak.get("Temp", 0) + peak.get("All Gather", 0)
    activations += peak.get("Reduce Scatter", 0) + peak.get("Unsharded Param", 0) + peak.get("Unsharded Grad", 0)
    return Footprint(
        batch=batch,
        params=params + peak.get("Buffer", 0),
        grads=grads,
        optimizer=_state_bytes(optimizer),
        activations=activations,
        inputs=inputs,
        buckets=extra,
        peak=peak["Total"] + extra,
        block=block,
    )


def _one_device(tracker: MemTracker) -> dict[Any, int]:
    snapshot = tracker.get_tracker_snapshot("peak")
    return next(iter(snapshot.values())) if snapshot else {"Total": 0}


def _inputs(example: Any) -> Any:
    """The model's inputs in ``example`` (what ``create_model`` runs once to materialise lazy layers)."""
    if isinstance(example, Mapping):
        return {k: v for k, v in example.items() if k not in batches.TARGET_KEYS}
    return example[0]


class _AloneStore(dist.Store):
    """The store of a process group whose other ranks do not exist: it keeps nothing and never waits, so that the
    barrier ``TORCH_DIST_INIT_BARRIER=1`` asks for passes at once (a HashStore would wait for the absent ranks)."""

    def set(self, key: str, value: bytes | str) -> None:
        pass

    def get(self, key: str) -> bytes:
        return b""

    def add(self, key: str, amount: int) -> int:
        return 0

    def check(self, keys: list[str]) -> bool:
        return True

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        pass


@contextlib.contextmanager
def _fake_group(world_size: int) -> Iterator[Any]:
    """A process group of ``world_size`` that exists only in this process (PyTorch's "fake" backend: collectives
    return at once), and its device mesh, made before the fake mode as FSDP2 reads the mesh's real ranks."""
    if world_size == 1:
        yield None
        return
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError("the memory plan needs its own process group: run it outside a distributed job")
    store = _AloneStore()  # held while the group lives: torch keeps only a C++ reference
    try:
        dist.init_process_group("fake", rank=0, world_size=world_size, store=store)
    # 2.14: AssertionError("Unknown c10d backend ...")
    except (AssertionError, ValueError, RuntimeError) as err:
        raise ConfigError(
            f"ignite-mgpu plan measures fsdp over {world_size} processes in this one process, with PyTorch's "
            f'"fake" process-group backend, and PyTorch {torch.__version__} does not provide it ({err}). Plan one '
            "process (--nproc 1: no fsdp row), or use a PyTorch that provides it (2.14 does, registered by "
            "torch.distributed.fsdp's import)."
        ) from err
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def shard(cfg: Config, model: nn.Module, mesh: Any) -> int:
    """``fully_shard`` as ``fsdp.shard_model`` applies it (the same blocks, precision, resharding); returns the
    largest unit's gathered parameter bytes in the compute dtype (the root's own parameters are a unit too)."""
    from ignite_mgpu.parallel.fsdp import check_blocks, default_blocks, fsdp_units, mixed_precision, shard_units

    m = cfg.model
    names = list(m.fsdp_blocks) if m.fsdp_blocks is not None else default_blocks(model)
    if m.fsdp_blocks is not None:
        check_blocks(model, names, m.name)
    units = fsdp_units(model, names)
    size = 2 if cfg.train.precision != "fp32" else None
    owned = _unit_bytes(model, units, size)
    policy = mixed_precision(cfg.train.precision)
    shard_units(model, units, m.fsdp_reshard_after_forward, mesh=mesh, mp_policy=policy)
    return max(owned, default=0)


def _unit_bytes(model: nn.Module, units: list[nn.Module], element_size: int | None) -> list[int]:
    """Each unit's own parameter bytes (nested units' excluded), the root's last; ``element_size`` the compute
    dtype's (None: the parameters' own)."""
    claimed: set[int] = set()
    sizes = []
    # Innermost first: a unit holds what its inner units do not.
    for unit in [*reversed(units), model]:
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        sizes.append(sum(p.numel() * (element_size or p.element_size()) for p in own))
    return sizes
