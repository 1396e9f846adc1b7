"""ignite-mgpu: multi-GPU training with PyTorch-Ignite. Public names are imported lazily (fast CLI start)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "launch": "ignite_mgpu.processes.launcher",
    "fit": "ignite_mgpu.jobs",
    "create_dataloader": "ignite_mgpu.train.data.loaders",
    "create_trainer": "ignite_mgpu.train.step.trainer",
    "create_evaluator": "ignite_mgpu.train.evaluator",
    "create_optimizer": "ignite_mgpu.train.optim",
    "create_lr_scheduler": "ignite_mgpu.train.optim",
    "validation_metrics": "ignite_mgpu.train.evaluator",
    "GuardEvents": "ignite_mgpu.train.step.guard",
    "prepare_model": "ignite_mgpu.parallel.strategy",
    "load_checkpoint": "ignite_mgpu.checkpoint.load",
    "save_weights": "ignite_mgpu.checkpoint.weights",
    "Config": "ignite_mgpu.config.schema",
    "ConfigError": "ignite_mgpu.errors",
    "CheckpointError": "ignite_mgpu.errors",
    "JobFailed": "ignite_mgpu.errors",
    "load_config": "ignite_mgpu.config.loading",
    "training": "ignite_mgpu.train.default_job",
    "keep_freed_memory": "ignite_mgpu.train.allocator",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ignite_mgpu' has no attribute {name!r}")
