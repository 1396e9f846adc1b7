"""The FSDP step compared: a hand-written FSDP2 loop (the ``fully_shard`` calls written out) against ignite-mgpu's
``training`` under ``--strategy fsdp``, on a tiny GPT-2 built from its config; the workload's model, data and
config, and both loops' final weights (gathered to full state dicts on rank 0)."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

BATCH = 16  # global batch: 8 sequences per process
BLOCK = 32  # tokens per sequence
GPT2 = {"vocab_size": 256, "n_positions": BLOCK, "n_embd": 64, "n_layer": 4, "n_head": 4}
VAL_SAMPLES = 64  # 4 validation batches: 2 per process
# workload -> title, iterations per measured epoch (default, --quick)
WORKLOADS = {"gpt2": ("tiny GPT-2 (FSDP)", 40, 6)}


def tiny_gpt2(**config: Any) -> nn.Module:
    """GPT-2 from its config, random init, nothing downloaded; dropout off: with it the two loops, which share the
    process's random generator and take turns, would draw other masks and end with other weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return GPT2LMHeadModel(GPT2Config(**(GPT2 | config | no_dropout)))


class Tokens(Dataset):
    """``n`` sequences of ``block`` random byte tokens (a seeded generator), as Hugging Face's causal LMs take them:
    ``input_ids``, ``attention_mask``, ``labels`` (the model shifts them)."""

    def __init__(self, n: int, block: int, seed: int) -> None:
        import torch

        self.ids = torch.randint(0, 256, (n, block), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def token_data(train: int, val: int = VAL_SAMPLES, block: int = BLOCK) -> dict[str, Dataset]:
    """``data.name`` factory: ``train`` and ``val`` sequences."""
    return {"train": Tokens(train, block, 0), "val": Tokens(val, block, 1)}


def make_config(workload: str, iters: int, epochs: int, output_dir: str | Path, nproc: int) -> Any:
    """The run's Config as ``ignite-mgpu train --strategy fsdp`` builds it: AdamW with warm-up and cosine, gradient
    clipping at 1.0 (as examples/huggingface/gpt2.yaml), the model's own loss; one epoch is one pass of
    ``iters * BATCH`` sequences; one full checkpoint after the last epoch (it holds (b)'s final weights)."""
    from ignite_mgpu.config.loading import load_config

    assert workload == "gpt2", workload
    return load_config(
        None,
        [
            "model.name=benchmarks.fsdp.step_loops:tiny_gpt2",
            "data.name=benchmarks.fsdp.step_loops:token_data",
            f"data.args={{train: {iters * BATCH}}}",
            f"data.batch_size={BATCH}",
            "train.loss=model",
            "train.clip_grad_norm=1.0",
            "optim.name=adamw",
            "optim.lr=0.001",
            "optim.weight_decay=0.01",
            "optim.warmup_epochs=0.1",
            f"train.epochs={epochs}",
            "train.progress_bar=false",
            f"checkpoint.every={epochs}",
            "dist.strategy=fsdp",
            "dist.backend=gloo",
            f"dist.nproc={nproc}",
            f"output_dir={output_dir}",
            "seed=0",
        ],
    )


def hand_built(cfg: Any) -> tuple[Any, ...]:
    """What the hand-written FSDP2 loop builds: sampler, loader, the model with ``fully_shard`` on each GPT2Block
    and then on the root (fp32: an empty ``MixedPrecisionPolicy``, as ``train.precision=fp32`` gives), AdamW over
    the sharded parameters, the schedule. Model, data, optimizer and schedule come from ignite-mgpu's factories, so
    both loops start from the same objects; the sharding and the loop are plain PyTorch."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    from ignite_mgpu.train.data.datasets import build_datasets, example_inputs
    from ignite_mgpu.train.models import create_model
    from ignite_mgpu.train.optim import create_lr_scheduler, create_optimizer

    world_size, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(cfg.seed)  # the generator state training() has when it builds the model
    train_ds = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed).train
    sampler = DistributedSampler(train_ds, world_size, rank, shuffle=cfg.data.shuffle, seed=cfg.seed)
    loader = DataLoader(train_ds, batch_size=cfg.data.batch_size // world_size, sampler=sampler)
    model = create_model(cfg.model, example_inputs(train_ds))
    policy = MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)  # reshard_after_forward=True, FSDP2's default
    fully_shard(model, mp_policy=policy)
    o = cfg.optim
    optimizer = create_optimizer(model, o.name, o.lr, o.momentum, o.weight_decay)
    steps = len(loader)
    total, warmup = steps * cfg.train.epochs, round(steps * o.warmup_epochs)
    scheduler = create_lr_scheduler(optimizer, total, warmup, o.scheduler == "cosine")
    return sampler, loader, model, optimizer, scheduler


def hand_steps(built: tuple[Any, ...], epochs: int, window: int | None) -> Generator[None, None, dict[str, Any]]:
    """(a): the FSDP2 training loop by hand, pausing after every ``window`` iterations; returns the final weights
    (full, on rank 0; every rank must take part in the gather)."""
    import torch

    sampler, loader, model, optimizer, scheduler = built
    model.train()
    done = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()  # FSDP reduce-scatters the gradients here
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            done += 1
            if window and done % window == 0:
                yield
    return full_weights(model)


def full_weights(model: nn.Module) -> dict[str, Any]:
    """The sharded model's full state dict, gathered to rank 0's CPU memory (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}
