"""How a model is wrapped for this process (DDP, DataParallel, FSDP, or placed as it is), how to get the user's
module back out, its gradient sync turned off on accumulation steps, and DataParallel's per-GPU loss vector reduced
to the batch loss."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ignite.distributed as idist
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ignite_mgpu.config.schema import STRATEGIES


def prepare_model(
    model: nn.Module,
    strategy: str = "ddp",
    sync_batchnorm: bool = False,
    compile: bool = False,
    *,
    fsdp_blocks: Sequence[str] | None = None,
    precision: str = "fp32",
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Place and wrap a model for this process: DDP through ``idist.auto_model``, DataParallel, or FSDP2.

    ``strategy="dp"`` gives a ``LossDataParallel``: plain DataParallel, except that a forward returning its own
    loss does not trigger the "all input tensors were scalars" warning, and each replica runs under the caller's
    autocast dtype. With "ddp" and a single process the model is only moved to ``idist.device()`` (``auto_model``
    would silently pick DataParallel when one process sees several GPUs). ``compile`` applies ``torch.compile`` to
    the DDP-wrapped model, as PyTorch recommends (its DDP optimizer keeps communication overlapping compute); under
    DataParallel, which replicates the module every step, the inner module is compiled.

    ``strategy="fsdp"`` shards parameters, gradients and optimizer state over the processes (``fsdp.shard_model``:
    ``fsdp_blocks`` names the block classes, ``precision`` becomes FSDP's mixed-precision policy, ``cpu_offload``
    its CPU offload); the model is changed in place. Create the optimizer afterwards. One process has nothing to
    shard: the model is placed as with "ddp".
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"strategy={strategy!r}: use 'ddp' (a process per GPU), 'dp' (nn.DataParallel) or 'fsdp' (sharded)."
        )
    if strategy == "dp":
        if not torch.cuda.is_available():
            raise ValueError("strategy='dp' (nn.DataParallel) needs CUDA GPUs; on the CPU use strategy='ddp'.")
        model = model.to(torch.device("cuda", 0))
        return LossDataParallel(torch.compile(model) if compile else model)
    if strategy == "fsdp" and sync_batchnorm:
        raise ValueError("strategy='fsdp' with sync_batchnorm=True: not combined here; use strategy='ddp'.")
    if strategy == "fsdp":
        from ignite_mgpu.parallel.fsdp import shard_model

        model = shard_model(model, fsdp_blocks, precision, cpu_offload, reshard_after_forward)
    elif idist.get_world_size() == 1:
        model = model.to(idist.device())
    else:
        model = idist.auto_model(model, sync_bn=sync_batchnorm)
    # An OptimizedModule.
    return torch.compile(model) if compile else model  # type: ignore[return-value]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel / torch.compile wrappers."""
    while True:
        # `is not None`, never `or`: the truth value of a module with __len__ (Sequential, a compiled one) calls len().
        inner = getattr(model, "module", None)
        if inner is None:
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel wrapper of a prepared model (also inside torch.compile), or None."""
    for candidate in (model, getattr(model, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def no_sync(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The context that keeps a backward's gradients local, for a prepared model: DDP's ``no_sync``, FSDP2's gradient
    sync off (``fsdp.no_sync_of``), ``nullcontext`` for DataParallel and a plain model, which sync nothing. Chosen
    once, when a step is built; entered on every micro-batch that does not end an accumulation window."""
    # DDP all-reduces (FSDP reduce-scatters) gradients in every backward; before a window's last micro-batch that
    # traffic is wasted: the gradients summed locally are synced once, by the last backward.
    ddp = find_ddp(model)
    if ddp is not None:
        return ddp.no_sync
    from ignite_mgpu.parallel.fsdp import find_fsdp, no_sync_of

    fsdp = find_fsdp(model)
    return no_sync_of(fsdp) if fsdp is not None else contextlib.nullcontext


def model_devices(model: nn.Module) -> list[torch.device]:
    """The devices a model runs on: every GPU of a DataParallel, else this rank's device (``prepare_model`` placed it
    there). Not its parameters' device: under FSDP's CPU offload they live on the CPU while the step runs on the GPU
    (the memory report and the run's facts would read the RAM and "no GPUs")."""
    if isinstance(model, nn.DataParallel):
        return [torch.device("cuda", i) for i in model.device_ids]
    return [idist.device()]


class LossDataParallel(nn.DataParallel):
    """``nn.DataParallel`` whose replicas may return their own 0-dim loss, and run under the caller's autocast dtype.

    Plain DataParallel gathers 0-dim outputs with the warning "Was asked to gather along dimension 0, but all
    input tensors were scalars"; here they become a vector quietly, and ``reduce_replica_losses`` weights them.
    Plain DataParallel also runs each replica in a thread of its own under ``autocast(enabled=...)`` without a dtype;
    the autocast dtype is per thread and CUDA's default is float16, so a bf16 forward would silently run in fp16
    (without the GradScaler fp16 needs). Here each replica enters the caller's dtype itself.
    """

    def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> Any:
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [_UnderAutocast(r, device_type, dtype) for r in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs: Any, output_device: Any) -> Any:
        return super().gather([_scalars_as_vectors(o) for o in outputs], output_device)


def _scalars_as_vectors(output: Any) -> Any:
    """A replica's output with every 0-dim tensor (its loss, also in a mapping such as {"loss": ..., "logits": ...})
    as a 1-element vector, which DataParallel gathers into one entry per GPU without the scalar warning."""
    if isinstance(output, torch.Tensor):
        return output.unsqueeze(0) if output.dim() == 0 else output
    if isinstance(output, Mapping):
        # As torch gathers.
        return type(output)((k, _scalars_as_vectors(v)) for k, v in output.items())  # type: ignore[call-arg]
    return output


class _UnderAutocast:
    """A replica called under a given autocast dtype (``parallel_apply`` only calls it)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def reduce_replica_losses(out: torch.Tensor, model: nn.Module, batch_size: int) -> torch.Tensor:
    """The batch loss from a forward that returns the loss itself.

    Under ``nn.DataParallel`` each replica returns the mean loss of its chunk and DataParallel stacks them into
    a vector. The chunks are uneven when the batch does not divide (10 samples on 4 GPUs: 3/3/3/1), so a plain
    mean is wrong: weight each replica's loss by its share of the batch.
    """
    if out.dim() == 0:
        return out
    if isinstance(model, nn.DataParallel) and out.dim() == 1:
        sizes = [len(c) for c in torch.arange(batch_size).chunk(len(model.device_ids))]
        if len(sizes) == out.numel():
            # Python floats as weights: a tensor of them built on the GPU would be a host-to-device copy per step.
            return sum((loss * (k / batch_size) for loss, k in zip(out, sizes, strict=True)), out.new_zeros(()))
    raise TypeError(
        f"with loss_fn=None the model's forward(x, y) must return the loss as a 0-dim tensor, but it returned "
        f"shape {tuple(out.shape)}. Return loss.mean() from forward, or pass a loss_fn and return the logits."
    )
