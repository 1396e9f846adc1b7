"""What a job runs in its workers (``Job``: ``fn(local_rank, *args)``, where ``fn`` may be named "module:function" so
that the launching process never imports it) and what its restart hook gives for restart k (``Restart``: the new
arguments and where they resume). Torch-free."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Job:
    """The function every worker runs, ``fn(local_rank, *args)``. A "module:function" name is imported in the
    worker: pickled for the workers, only the name travels, so the launching process starts them without
    importing ignite or the training code (a second per start)."""

    fn: Callable[..., Any] | str
    args: tuple = ()

    def call(self, local_rank: int) -> Any:
        """Run the job in this process (a worker), the named function imported first."""
        fn = self.fn
        if isinstance(fn, str):
            module, _, name = fn.partition(":")
            fn = getattr(importlib.import_module(module), name)
        return fn(local_rank, *self.args)

    def again(self, args: tuple) -> Job:
        """The same function with other arguments (a restart's)."""
        return dataclasses.replace(self, args=args)

    @property
    def module(self) -> str:
        """The module of ``fn`` (named or not), for the fork server's preload."""
        if isinstance(self.fn, str):
            return self.fn.partition(":")[0]
        return str(getattr(self.fn, "__module__", ""))


@dataclass(frozen=True)
class Restart:
    """What a job's restart hook returns for restart k: the new arguments of ``fn`` and where they resume."""

    args: tuple
    # The checkpoint the restarted job resumes from (None: from its beginning)
    checkpoint: str | None = None
    iteration: int = 0  # that checkpoint's iteration
    # False: a plain function run again (launch()), nothing known about its progress.
    resumes: bool = True
    # What runs again from its start when it does not resume (a script's name)
    name: str = "the job function"

    def where(self) -> str:
        """Where the restarted job goes on from, as the restart's message says it."""
        if not self.resumes:
            return f"running {self.name} again from its start"
        if self.checkpoint:
            return f"resuming from {self.checkpoint} at iteration {self.iteration}"
        return "from the beginning (no complete checkpoint yet)"
