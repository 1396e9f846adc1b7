"""The atomic saver of checkpoint files: a private temp file, fsynced, renamed into place, its folder fsynced, and
only then the files it replaces deleted."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.handlers import DiskSaver

from ignite_mgpu.checkpoint.files import SAFETENSORS, TEMP_PREFIX, TEMP_SUFFIX, fsync_dir, list_checkpoints, on_cpu
from ignite_mgpu.checkpoint.weights import write_safetensors
from ignite_mgpu.errors import CheckpointError
from ignite_mgpu.runs.writable import no_space_message


class SafeDiskSaver(DiskSaver):
    """DiskSaver that writes a private temp file, fsyncs it, renames it, fsyncs the folder, and only then deletes
    the old checkpoint.

    ignite's Checkpoint asks to remove the oldest file *before* saving the new one (pytorch-ignite #1986): a crash
    or a full disk in between would leave no checkpoint. Removals are deferred until the next save succeeds.
    Files are created 0600 (ignite's DiskSaver adds group/other read bits). A ``.safetensors`` name is written as
    safetensors (``weights.write_safetensors``, as atomic), with ``metadata``. A GPU's tensors are written as CPU
    tensors (``on_cpu``): the file loads with plain ``torch.load`` on a machine without a GPU, and never onto cuda:0.
    """

    def __init__(self, dirname: str | Path, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(dirname, atomic=True, create_dir=True, require_empty=False)
        self._pending: list[str] = []
        self.metadata = dict(metadata or {})

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        # ignite's rule (but for its TPU branch: every process, xm.save)
        if idist.get_rank() == self.save_on_rank:
            self._commit(on_cpu(checkpoint), Path(self.dirname) / filename, torch.save, self._pending)

    def _commit(self, checkpoint: Mapping, path: Path, func: Callable, pending: list[str]) -> None:
        """Write ``path`` atomically, then delete the files of ``pending`` (and clear it); on an error nothing is
        deleted."""
        try:
            if path.suffix == SAFETENSORS:
                write_safetensors(checkpoint, path, self.metadata)
            else:
                self._write(checkpoint, path, func)
        except BaseException as err:
            kept = ", ".join(p.name for p in reversed(list_checkpoints(self.dirname))) or "none"
            # torch's zip writer says a full disk as "unexpected pos"; the errno is lost on the way.
            full = getattr(err, "errno", None) == errno.ENOSPC or "unexpected pos" in str(err)
            why = no_space_message(self.dirname) if full else str(err)
            raise CheckpointError(f"saving {path.name} failed ({why}); kept the previous checkpoints: {kept}") from err
        fsync_dir(self.dirname)  # the rename survives a power loss only once its folder is synced
        for name in pending:
            # ignite "removes" a file it is about to overwrite under the same name.
            if name != path.name:
                (Path(self.dirname) / name).unlink(missing_ok=True)
        pending.clear()

    def _write(self, checkpoint: Mapping, path: Path, func: Callable) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dirname, prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                func(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def remove(self, filename: str) -> None:
        if idist.get_rank() == self.save_on_rank:
            self._pending.append(filename)
