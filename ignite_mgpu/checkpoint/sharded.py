"""Sharded checkpoints (``checkpoint.format=sharded``): a ``checkpoint_<iteration>/`` folder into which every rank
writes its shards through ``torch.distributed.checkpoint``, made atomic as our files are; resuming from one on any
number of processes. ignite is imported only when saving."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ignite_mgpu.checkpoint.files import (
    METADATA,
    TEMP_PREFIX,
    TRAIN_STATE,
    fsync_dir,
    is_complete,
    list_checkpoints,
    on_cpu,
    read_checkpoint,
)
from ignite_mgpu.env import stop
from ignite_mgpu.errors import CheckpointError

if TYPE_CHECKING:
    from ignite.engine import Engine
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ignite_mgpu.checkpoint.background import BackgroundWriter

logger = logging.getLogger(__name__)
# Written by every rank through torch.distributed.checkpoint; the rest by rank 0.
SHARDED = ("model", "optimizer")


class ShardedCheckpoint:
    """An engine handler that writes ``checkpoint_<iteration>/`` and keeps the newest ``n_saved`` folders.

    ``to_save`` is what ``checkpoint_*.pt`` would hold: ``model`` and ``optimizer`` (plain, or the FSDP adapters of
    ``state.checkpoint_objects``) are saved sharded, everything else into ``train_state.pt``. Every rank must call it.
    ``async_save``: the shards are written by ``torch.distributed.checkpoint.async_save`` (a snapshot, then a
    background thread, its collectives over a gloo group of their own), the rename and the rotation after it on
    rank 0; at most one write in flight; ``finish()`` awaits it.
    """

    def __init__(self, to_save: Mapping[str, Any], dirname: str | Path, n_saved: int, async_save: bool = False) -> None:
        self.to_save, self.dirname, self.n_saved = to_save, Path(dirname), n_saved
        self.writer: BackgroundWriter | None = None
        if async_save:
            import ignite.distributed as idist

            from ignite_mgpu.checkpoint.background import BackgroundWriter

            self.writer = BackgroundWriter("ignite-mgpu sharded checkpoint writer", idist.device().type)
            # the background collectives must not interleave with training's: a group of their own (every rank)
            self._group = (
                None if _alone() else torch.distributed.new_group(backend="gloo", timeout=stop.group_timeout())
            )

    def __call__(self, engine: Engine) -> None:
        folder = self.dirname / f"checkpoint_{engine.state.iteration}"
        if self.writer is None:
            save_sharded(self.to_save, folder)
            self._rotate()
            return
        self.writer.wait()  # at most one in flight: the stager's buffers hold the previous snapshot
        upload = save_sharded_async(self.to_save, folder, self.writer.stager(), self._group)

        def write() -> None:
            with _saving_error(folder):
                upload.result()
                _commit(folder)
            self._rotate()

        self.writer.submit(write)

    def _rotate(self) -> None:
        import ignite.distributed as idist

        if idist.get_rank() == 0:
            # Only complete folders count: an incomplete one never pushes a good one out (nor is it deleted).
            for old in [p for p in list_checkpoints(self.dirname) if p.is_dir() and is_complete(p)][self.n_saved :]:
                shutil.rmtree(old, ignore_errors=True)

    def finish(self) -> None:
        """Wait for the write in flight (raising its error as a CheckpointError), free the snapshot's buffers."""
        if self.writer is not None:
            self.writer.finish()


def save_sharded(to_save: Mapping[str, Any], folder: Path) -> None:
    """Write ``folder`` atomically: every rank writes its shards into ``.tmp-<name>/``; torch.distributed.checkpoint
    writes ``.metadata`` last, once every rank's files are on disk (fsynced); then rank 0 renames the folder.
    A folder without ``.metadata`` is therefore incomplete, and ``--resume auto`` skips it."""
    import torch.distributed.checkpoint as dcp

    state = _prepare(to_save, folder)
    with _saving_error(folder):
        with single_process_quietly():
            # Returns on every rank after .metadata.
            dcp.save(state, checkpoint_id=str(_temp(folder)), **no_dist(_alone()))
        _commit(folder)


def save_sharded_async(to_save: Mapping[str, Any], folder: Path, stager: Any, group: Any) -> Future:
    """``save_sharded``'s writing started in the background (``torch.distributed.checkpoint.async_save``): returns
    once the state is staged; the future's result is there when every rank's shards and ``.metadata`` are on disk.
    ``_commit(folder)`` must follow, as in ``save_sharded``."""
    import torch.distributed.checkpoint as dcp

    state = _prepare(to_save, folder)
    with _saving_error(folder), single_process_quietly():
        # The stager's PyTorch (2.9+) takes no_dist.
        upload = dcp.async_save(
            state, checkpoint_id=str(_temp(folder)), process_group=group, async_stager=stager, no_dist=_alone()
        )
    # A Future: the stager stages synchronously (an AsyncSaveResponse otherwise)
    return cast(Future, upload)


def _temp(folder: Path) -> Path:
    return folder.with_name(TEMP_PREFIX + folder.name)


def _prepare(to_save: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """Rank 0 makes an empty ``.tmp-<name>/`` and writes ``train_state.pt`` into it; every rank waits for that.
    Returns what torch.distributed.checkpoint writes: this rank's model and optimizer state."""
    import ignite.distributed as idist

    # torch.distributed's, when saving.
    from ignite_mgpu.checkpoint.state import module_and_optimizer, sharded_state

    tmp = _temp(folder)
    module, optimizer = module_and_optimizer(to_save["model"], to_save.get("optimizer"))
    state = sharded_state(module, optimizer)
    rest = {name: obj.state_dict() for name, obj in to_save.items() if name not in SHARDED}
    if idist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed writer's shards must not mix with these
        tmp.mkdir(parents=True)
        torch.save(on_cpu(rest), tmp / TRAIN_STATE)  # loads without a GPU
    idist.barrier()  # the folder exists and is empty of old shards before any rank writes into it
    return state


def _commit(folder: Path) -> None:
    """On rank 0: the complete ``.tmp-<name>/`` renamed to ``folder`` (replacing one of the same iteration)."""
    import ignite.distributed as idist

    if idist.get_rank() != 0:
        return
    tmp = _temp(folder)
    fsync_dir(tmp)
    # Removed at the next start if left.
    replaced = folder.with_name(f"{TEMP_PREFIX}{folder.name}.old")
    if folder.exists():  # resumed from an earlier checkpoint: this iteration is written again
        os.replace(folder, replaced)
    os.replace(tmp, folder)
    fsync_dir(folder.parent)  # the rename survives a power loss only once its folder is synced
    shutil.rmtree(replaced, ignore_errors=True)


@contextlib.contextmanager
def _saving_error(folder: Path) -> Iterator[None]:
    """A write's OSError (and torch.distributed.checkpoint's report of one on any rank) as a CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (OSError, CheckpointException) as err:
        reason = str(err)
        # Its text is every rank's traceback: the errors suffice.
        if isinstance(err, CheckpointException):
            reason = "; ".join(f"rank {rank}: {exc}" for rank, (exc, _) in sorted(err.failures.items()))
        kept = ", ".join(p.name for p in reversed(list_checkpoints(folder.parent))) or "none"
        raise CheckpointError(
            f"saving {folder.name}/ failed ({reason}); kept the previous checkpoints: {kept}"
        ) from err


def _alone() -> bool:
    """No process group: one process reads or writes every shard itself."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def no_dist(alone: bool) -> dict[str, bool]:
    """torch.distributed.checkpoint's ``no_dist`` keyword (``alone``: one process reads or writes every shard),
    where its save and load take it; PyTorch 2.4's infer it from whether a process group is initialised, as
    ``_alone()`` does."""
    import torch.distributed.checkpoint as dcp

    return {"no_dist": alone} if "no_dist" in inspect.signature(dcp.save).parameters else {}


@contextlib.contextmanager
def single_process_quietly() -> Iterator[None]:
    # torch.distributed.checkpoint warns at every use without a process group, which is intended here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)
        yield


def tensor_metadata(folder: Path) -> dict[str, TensorStorageMetadata]:
    """The saved tensors of ``folder`` by name ("model.fc.weight", "optimizer.state.fc.weight.exp_avg", ...)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (folder / METADATA).is_file():
        raise CheckpointError(
            f"{folder} is an incomplete sharded checkpoint: it has no {METADATA}, which is written last (a writer "
            "was stopped, or the folder was copied in part). Use an earlier checkpoint; --resume auto skips it."
        )
    metadata = FileSystemReader(str(folder)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def model_shapes(folder: Path) -> dict[str, torch.Tensor]:
    """The model's tensors in ``folder`` as empty tensors on the meta device (names, shapes, dtypes; no data)."""
    return {
        name[len("model.") :]: torch.empty(md.size, dtype=md.properties.dtype, device="meta")
        for name, md in tensor_metadata(folder).items()
        if name.startswith("model.")
    }


def load_sharded(
    folder: Path, to_load: Mapping[str, Any], check: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Restore ``to_load`` from ``folder`` on this process count, whatever the count that wrote it (the shards are
    read as this rank needs them). Keys and shapes, and ``check`` (given ``train_state.pt``), are checked before
    anything is loaded. Every rank must call it. Returns ``train_state.pt``'s contents."""
    import torch.distributed.checkpoint as dcp

    from ignite_mgpu.checkpoint.load import check_model_state
    from ignite_mgpu.checkpoint.state import load_sharded_state, module_and_optimizer, sharded_state

    # On the CPU: each load_state_dict places its tensors (RNG states must stay there; see checkpoint/load.py).
    state = read_checkpoint(folder / TRAIN_STATE, "cpu")
    absent = [k for k in to_load if k not in SHARDED and k not in state]
    if absent:
        raise CheckpointError(f"{folder / TRAIN_STATE} has no {', '.join(absent)} (it holds: {', '.join(state)}).")
    module, optimizer = module_and_optimizer(to_load["model"], to_load.get("optimizer"))
    check_model_state(module, model_shapes(folder), str(folder))
    if check is not None:
        check(state)
    live = sharded_state(module, optimizer)
    with single_process_quietly():
        dcp.load(live, checkpoint_id=str(folder), **no_dist(_alone()))
    load_sharded_state(module, optimizer, live)
    for name, obj in to_load.items():
        if name not in SHARDED:
            obj.load_state_dict(state[name])
    return state
