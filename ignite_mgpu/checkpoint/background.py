"""Asynchronous checkpoints (``checkpoint.async_save``): the step that saves takes a snapshot of the state (a CPU
copy of every tensor, into pinned memory on CUDA, by torch.distributed.checkpoint's stager, whose buffers are
reused from save to save), and one background thread writes it. At most one write is in flight: a save first waits
for the previous write, and raises its error.

A thread, not a process: torch.save and torch.distributed.checkpoint write tensor bytes with the GIL released, so
the training thread keeps its speed (``benchmarks/checkpoint/bench_checkpoint_stall.py`` measures the iterations
during a write), and nothing is copied a second time into shared memory as a process would need.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ignite.distributed as idist
import torch

from ignite_mgpu.checkpoint.disk import SafeDiskSaver
from ignite_mgpu.env import stop
from ignite_mgpu.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager


class BackgroundWriter:
    """Runs one write at a time in a background thread; ``wait()`` joins it and raises its error as a
    ``CheckpointError``. The thread is not a daemon: an interpreter that exits normally finishes the write first.
    While a write runs, the worker's status says it is saving (``stop.saving``): a supervisor stopping the job after
    another rank's failure lets it land. It also keeps the snapshot's buffers (``stager``), which the write in
    flight reads: ``finish()`` awaits the write and frees them."""

    def __init__(self, name: str, device_type: str = "cpu") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._device_type = device_type
        self._stager: DefaultStager | None = None
        self.write_seconds = 0.0  # how long the last finished write took, in the background

    def stager(self) -> DefaultStager:
        """The stager for the next snapshot (created at the first save); call it after ``wait()``: its buffers
        hold the previous snapshot until that write is done."""
        if self._stager is None:
            self._stager = create_stager(self._device_type)
        return self._stager

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], None]) -> None:
        """Wait for the previous write (raising its error), then start ``write`` in the background."""
        self.wait()

        def run() -> None:
            start = time.perf_counter()
            try:
                with stop.saving():
                    write()
            except BaseException as err:  # raised on the training thread by the next wait()
                self._error = err
            finally:
                self.write_seconds = time.perf_counter() - start

        self._thread = threading.Thread(target=run, name=self.name)
        self._thread.start()

    def wait(self) -> None:
        """Block until no write is in flight; a failed write's error is raised here, once."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"a background checkpoint write failed ({error!r})") from error

    def finish(self) -> None:
        """Wait for the write in flight (raising its error) and free the snapshot's buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def stager_available() -> bool:
    """Whether this PyTorch has torch.distributed.checkpoint's ``DefaultStager`` (2.9 or newer), which snapshots a
    state dict for a background write."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
    except ImportError:
        return False
    return True


def create_stager(device_type: str) -> DefaultStager:
    """torch.distributed.checkpoint's stager: copies a state dict's tensors to the CPU (pinned, non-blocking on
    CUDA), keeping ties and every other value, into buffers it keeps for the next save."""
    if not stager_available():
        raise ConfigError(
            f"checkpoint.async_save=true needs torch.distributed.checkpoint's DefaultStager (PyTorch 2.9 or newer); "
            f"this is PyTorch {torch.__version__}. Upgrade PyTorch, or set checkpoint.async_save=false."
        )
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device_type == "cuda"
    # Pinned, shared memory, async staging, non-blocking.
    return DefaultStager(StagingOptions(cuda, False, False, cuda))


def stage(stager: DefaultStager, state: Any) -> Any:
    """The snapshot of ``state``: its tensors copied, and landed (the stager synchronizes its non-blocking copies);
    the previous snapshot's buffers are overwritten, so the previous write must have finished."""
    return stager.stage(state)


class AsyncDiskSaver(SafeDiskSaver):
    """``checkpoint.async_save``: the saving step only snapshots the checkpoint (``background.stage``); the write,
    fsync, rename, folder fsync and the deferred removals run in a background thread, at most one at a time.

    Every guarantee of ``SafeDiskSaver`` holds: the old files go only once the new one is complete, a failed write
    deletes nothing, and its ``CheckpointError`` is raised on the training thread at the next save or at
    ``finish()``. ``stall_seconds``: the training thread's time in the last save (waiting for the previous write,
    and the snapshot). ``fresh``: the checkpoint's entries whose state dicts are new CPU tensors at every save (an
    FSDP model's and optimizer's gathered state), written as they are: staging them would pin a second copy of the
    whole state on rank 0 at every save, since the stager's buffers are kept per tensor and these are new each time.
    """

    def __init__(self, dirname: str | Path, device_type: str = "cpu", fresh: Collection[str] = ()) -> None:
        super().__init__(dirname)
        self.writer = BackgroundWriter("ignite-mgpu checkpoint writer", device_type)
        self.stall_seconds = 0.0
        self.fresh = frozenset(fresh)

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        if idist.get_rank() != self.save_on_rank:
            return
        start = time.perf_counter()
        self.writer.wait()  # at most one in flight: the snapshot's buffers are the previous write's
        staged = stage(self.writer.stager(), {k: v for k, v in checkpoint.items() if k not in self.fresh})
        staged = {k: checkpoint[k] if k in self.fresh else staged[k] for k in checkpoint}
        path, pending = Path(self.dirname) / filename, self._pending
        self._pending = []  # what ignite removes from now on goes after the next write

        def write() -> None:
            try:
                # torch.save looked up now.
                self._commit(staged, path, lambda obj, f: torch.save(obj, f), pending)
            except BaseException:
                self._pending.extend(pending)  # removed after the next write that succeeds
                raise

        self.writer.submit(write)
        self.stall_seconds = time.perf_counter() - start

    def finish(self) -> None:
        """Wait for the write in flight (raising its error) and free the snapshot's buffers."""
        self.writer.finish()
