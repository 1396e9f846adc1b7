"""The start-up tracer of ``bench_startup.py``: with this folder on PYTHONPATH and ``BENCH_STARTUP_TRACE`` naming a
file, every process of a command (the launcher, a fork server, each worker) appends one line per event to that file:
``<time.time()> <pid> <parent pid> <rank or -1> <event>``. Nothing of the command is changed; torch is never imported
here: the hooks are set when the command itself imports the modules they belong to.

Events, once per process: ``interpreter`` (this file runs: the interpreter and site are up), ``forked`` (a process
forked from another: a fork server's worker), ``torch``, ``torch._dynamo`` and ``ignite`` (their import finished),
``process group`` (``init_process_group`` returned), ``model wrapped`` (DDP's constructor returned: the parameters
are broadcast), ``loop`` (a DataLoader's first iterator made: the training loop begins), ``first backward`` (an
optimizer's first ``step`` begins: the first batch's forward and backward are done) and ``first step`` (that
``step`` returned). The optimizer events come from torch's public global hooks
(``register_optimizer_step_pre_hook`` / ``_post_hook``); two functions are wrapped where torch has no hook.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_TRACE = os.environ.get("BENCH_STARTUP_TRACE")
_seen: set[tuple[int, str]] = set()


def event(name: str) -> None:
    """One line for ``name`` in this process, the first time only (O_APPEND: lines of processes never mix)."""
    key = (os.getpid(), name)
    if _TRACE is None or key in _seen:
        return
    _seen.add(key)
    dist = sys.modules.get("torch.distributed")
    rank = dist.get_rank() if dist is not None and dist.is_available() and dist.is_initialized() else -1
    fd = os.open(_TRACE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{time.time():.6f} {os.getpid()} {os.getppid()} {rank} {name}\n".encode())
    finally:
        os.close(fd)


def _after(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        event(name)
        return result

    return wrapper


def _torch(module: Any) -> None:
    event("torch")


def _dynamo(module: Any) -> None:
    event("torch._dynamo")


def _ignite(module: Any) -> None:
    event("ignite")


def _c10d(module: Any) -> None:
    module.init_process_group = _after(module.init_process_group, "process group")


def _ddp(module: Any) -> None:
    module.DistributedDataParallel.__init__ = _after(module.DistributedDataParallel.__init__, "model wrapped")


def _dataloader(module: Any) -> None:
    module.DataLoader.__iter__ = _after(module.DataLoader.__iter__, "loop")


def _optimizer(module: Any) -> None:
    module.register_optimizer_step_pre_hook(lambda *_: event("first backward"))
    module.register_optimizer_step_post_hook(lambda *_: event("first step"))


HOOKS = {
    "torch": _torch,
    "torch._dynamo": _dynamo,
    "ignite": _ignite,
    "torch.distributed.distributed_c10d": _c10d,
    "torch.nn.parallel.distributed": _ddp,
    "torch.utils.data.dataloader": _dataloader,
    "torch.optim.optimizer": _optimizer,
}


class _Hooks(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module of HOOKS, the spec the other finders give, whose loader runs the hook
    once the module has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        hook = HOOKS.pop(name, None)
        if hook is None:
            return None
        spec = importlib.util.find_spec(name)  # HOOKS no longer names it: no recursion
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            hook(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _TRACE:
    event("interpreter")
    sys.meta_path.insert(0, _Hooks())
    os.register_at_fork(after_in_child=lambda: event("forked"))
