"""Checkpoint files on disk: their names, which are complete, reading one safely (``weights_only=True``, or a
safetensors file with its ties restored), wrapper prefixes, a state's CPU copy to write. The leaf of the package.

Imports neither torch nor ignite at import: the launching process checks the output folder with it before it spawns
the workers, and only reading a file imports torch (about 3 s on a small machine, at every start otherwise).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ignite_mgpu.errors import CheckpointError

# The best model's name, with the run folder's names.
from ignite_mgpu.runs.folder import BEST_NAME as BEST_NAME
from ignite_mgpu.runs.regular import NotRegular, opened_regular, why_not_regular

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP and torch.compile wrappers
# A file (format full) or a folder (format sharded)
CKPT_NAME = re.compile(r"^checkpoint_(\d+)(\.pt)?$")
# A corrupt checkpoint_<n>.pt that rotation set aside (never counted, never deleted).
CORRUPT_SUFFIX = ".corrupt"
TEMP_PREFIX, TEMP_SUFFIX = ".tmp-", ".pt"  # a file being written; renamed into place once complete
# Weights only, no pickle: checkpoint.best_format=safetensors, checkpoint convert.
SAFETENSORS = ".safetensors"
# A safetensors file's metadata: JSON {name not written: the name whose tensor it shares}.
TIED = "ignite_mgpu.tied"
# Written by torch.distributed.checkpoint last, once every rank's shards are on disk.
METADATA = ".metadata"
# In a sharded folder: everything but the model and the optimizer, one plain file.
TRAIN_STATE = "train_state.pt"
_SKIPPED: set[Path] = set()  # the names list_checkpoints has warned about


def list_checkpoints(dirname: str | Path) -> list[Path]:
    """``checkpoint_<iteration>.pt`` files and ``checkpoint_<iteration>/`` folders, newest (highest iteration)
    first; by recorded step, never mtime."""
    found = [(int(m.group(1)), p) for p in Path(dirname).glob("checkpoint_*") if (m := CKPT_NAME.match(p.name))]
    found = [(it, p) for it, p in found if p.is_dir() != p.name.endswith(".pt") and _regular_or_folder(p)]
    return [p for _, p in sorted(found, reverse=True)]


def _regular_or_folder(path: Path) -> bool:
    """A checkpoint's name on a FIFO, a device or a socket (or a symlink to one) is skipped, with a warning: reading
    it would block or never end."""
    why = None if path.is_dir() else why_not_regular(path)
    if why is not None and path not in _SKIPPED:  # said once: the folder is listed at every save and resume
        _SKIPPED.add(path)
        logger.warning("skipping %s: it %s; only regular files are read as checkpoints", path, why)
    return why is None


def is_complete(path: Path) -> bool:
    """True when ``path`` is a whole torch zip archive whose every record passes its CRC check, or a sharded folder
    with its metadata and a complete train state."""
    if path.is_dir():
        return (path / METADATA).is_file() and is_complete(path / TRAIN_STATE)
    if is_safetensors(path):
        return _safetensors_complete(path)
    try:  # a FIFO would block, /dev/zero would be read without end: regular files only
        with opened_regular(path) as name, zipfile.ZipFile(name) as zf:
            return zf.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError):  # NotRegular is an OSError
        return False


def is_safetensors(path: str | Path) -> bool:
    """A safetensors file: by its suffix, or by its first bytes (the header's length, then its JSON's ``{``)."""
    path = Path(path)
    if path.suffix == SAFETENSORS:
        return True
    try:
        with opened_regular(path) as name, open(name, "rb") as f:
            head = f.read(9)
    except OSError:  # NotRegular too
        return False
    return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") < 2**27


def _has_torch_header(path: Path) -> bool:
    """torch.save's first bytes: a zip archive's, or the legacy format's pickled magic number."""
    try:
        with opened_regular(path) as name, open(name, "rb") as f:
            head = f.read(4)
    except OSError:  # NotRegular too
        return False
    return head in (b"PK\x03\x04", b"\x80\x02\x8a\x0a")


def _safetensors_complete(path: Path) -> bool:
    """The header reads as JSON and the file ends where its last tensor does (the format covers every byte)."""
    try:
        with opened_regular(path) as name, open(name, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header: dict[str, Any] = json.loads(f.read(size)) if 0 < size < 2**27 else {}
            length = os.fstat(f.fileno()).st_size
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        if not header:
            return False
        return length == 8 + size + max(ends, default=0)
    except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError):
        return False


def weights_only_resume(resume: str | None) -> bool:
    """``--resume`` names a safetensors file: weights only, so a new run starts from them (not an exact resume)."""
    return resume not in (None, "auto") and is_safetensors(str(resume))


def find_resumable(dirname: str | Path) -> Path | None:
    """The newest complete checkpoint; a truncated/corrupt newer one is skipped with a warning."""
    for path in list_checkpoints(dirname):
        if is_complete(path):
            return path
        what = (
            f"incomplete sharded checkpoint (no {METADATA} or {TRAIN_STATE})"
            if path.is_dir()
            else ("corrupt or truncated (incomplete zip archive)")
        )
        logger.warning("skipping %s: %s; trying the previous one", path, what)
    return None


def clean_stale_temp_files(dirname: str | Path) -> None:
    """Remove temp files and folders a killed writer left behind (only ours: ``.tmp-*.pt``, ``.tmp-*.safetensors``,
    ``.tmp-checkpoint_*``)."""
    for suffix in (TEMP_SUFFIX, SAFETENSORS):
        for tmp in Path(dirname).glob(f"{TEMP_PREFIX}*{suffix}"):
            tmp.unlink(missing_ok=True)
    for tmp in Path(dirname).glob(f"{TEMP_PREFIX}checkpoint_*"):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)


def fsync_dir(folder: str | Path) -> None:
    """Best effort: some network and virtual file systems refuse to fsync a folder (the file is in place anyway)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        logger.debug("fsync of folder %s failed: %s", folder, err)


# ------------------------------------------------------------------------------------------ reading older files


@contextlib.contextmanager
def _numpy_rng_globals() -> Iterator[None]:
    # Checkpoints written before plain_rng_states hold numpy's RNG state; allow exactly its types while reading.
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]  # numpy 1 location
    allowed: list[Any] = [np.ndarray, np.dtype, _reconstruct]
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64")]
    # how pickle writes the arrays' bytes: newer PyTorch allows it by default, 2.4 does not
    allowed.append(codecs.encode)
    import torch

    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is None:  # PyTorch 2.4 has no such context manager: the same scope through the public list
        before = list(torch.serialization.get_safe_globals())
        torch.serialization.add_safe_globals(allowed)
        try:
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(before)
        return
    with scoped(allowed):
        yield


# ------------------------------------------------------------------------------------------ reading


def read_checkpoint(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """``torch.load(..., weights_only=True)`` with errors that say what is wrong. Never runs pickled code.
    ``mmap``: the tensors mapped from the file, not read (for a look at its other entries)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(sharded_folder_message(path))
    why = why_not_regular(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} {why}; pass the path of a .pt or .safetensors file.")
    if is_safetensors(path):
        return read_safetensors(path, map_location)[0]
    import torch

    try:
        with opened_regular(path) as name, _numpy_rng_globals():
            obj = torch.load(name, map_location=map_location, weights_only=True, mmap=mmap)
    except NotRegular as err:  # swapped for something else since the check above
        raise CheckpointError(f"checkpoint {err}; pass the path of a .pt or .safetensors file.") from None
    except Exception as err:
        text = str(err) or type(err).__name__
        if path.stat().st_size == 0:
            raise CheckpointError(
                f"{path} is empty (0 bytes): its writer was stopped, or it is not a checkpoint."
            ) from None
        # Random bytes fail as "Unsupported operand" (or, on PyTorch 2.4, as whatever its unpickler trips on):
        # garbage, not code; only a global names code to run.
        if "Weights only load failed" in text and "global" in text.lower():
            first = next((ln for ln in text.splitlines()[1:] if "global" in ln.lower()), text.splitlines()[0])
            raise CheckpointError(
                f"refusing to load {path}: it needs arbitrary Python code to unpickle ({first.strip()}). It was "
                "NOT executed. Only load files you trust; re-save trusted weights as a plain state_dict."
            ) from None
        why = (
            "not a torch checkpoint: its bytes are neither a zip archive nor a pickle"
            if "Unsupported operand" in text or not _has_torch_header(path)
            else text.splitlines()[0]
        )
        raise CheckpointError(f"{path} is corrupt or truncated and cannot be loaded ({why}).") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state_dict or a checkpoint dict.")
    return obj


def read_safetensors(path: Path, map_location: Any = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors, each tie restored as one tensor under all its names, and its metadata."""
    from safetensors import SafetensorError, safe_open

    try:
        with opened_regular(path) as by_fd, safe_open(by_fd, framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            state = {name: f.get_tensor(name) for name in f.keys()}
    except NotRegular as err:
        raise CheckpointError(f"checkpoint {err}; pass the path of a .pt or .safetensors file.") from None
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path} is corrupt or truncated and cannot be loaded (safetensors: {err}).") from None
    try:
        tied = json.loads(metadata.get(TIED, "{}"))
        state.update({name: state[kept] for name, kept in tied.items()})
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(
            f"{path}: its metadata {TIED}={metadata[TIED]!r} does not name tensors of the file: it was edited or "
            "written by another tool. Write the file again (ignite-mgpu checkpoint convert)."
        ) from None
    import torch

    device = torch.device(map_location)
    if device.type != "cpu":
        moved: dict[int, torch.Tensor] = {}  # a tie stays one tensor on the device
        for t in state.values():
            if id(t) not in moved:
                moved[id(t)] = t.to(device)
        state = {name: moved[id(t)] for name, t in state.items()}
    return state, metadata


def sharded_folder_message(path: Path) -> str:
    """Why a sharded checkpoint folder is not a file ``torch.load`` reads, and what to do with it."""
    return (
        f"{path} is a sharded checkpoint folder (checkpoint.format=sharded: each rank wrote its shards through "
        "torch.distributed.checkpoint), not a file that torch.load reads. Resume from it with --resume "
        f"{path} (or auto), on any number of processes, or turn its model into one plain state_dict file with "
        f"`ignite-mgpu checkpoint convert {path} model.pt`."
    )


def strip_prefixes(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Remove wrapper prefixes that every key carries (``module.``, ``_orig_mod.``); returns (clean, found)."""
    clean, found = dict(state_dict), []
    changed = True
    while changed and clean:
        changed = False
        for prefix in PREFIXES:
            if all(k.startswith(prefix) for k in clean):
                clean = {k[len(prefix) :]: v for k, v in clean.items()}
                found.append(prefix)
                changed = True
    return clean, found


def is_state_dict(obj: Mapping[str, Any]) -> bool:
    import torch

    return bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def on_cpu(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples of tensors and other values) with every tensor off the CPU copied to it, each
    storage once: tensors that share one (tied weights; ``state_dict``'s detached views) still share it, as
    ``torch.save`` would write them. A container with nothing to copy is returned as it is (a CPU run's state is
    written unchanged, its ``state_dict``'s ``_metadata`` included)."""
    return _to_cpu(obj, {})


def _to_cpu(obj: Any, copies: dict[tuple[Any, int], torch.UntypedStorage]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):  # a subclass (DTensor) copies itself
            return obj.cpu()
        storage = obj.untyped_storage()
        key = (obj.device, storage.data_ptr())
        if key not in copies:
            copies[key] = storage.cpu()
        return torch.empty(0, dtype=obj.dtype).set_(copies[key], obj.storage_offset(), obj.shape, obj.stride())
    if isinstance(obj, Mapping):
        items = {k: _to_cpu(v, copies) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        out = cast(Any, type(obj))(items)
        if hasattr(obj, "_metadata"):  # a module's state_dict: the versions its load_state_dict reads
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        values = [_to_cpu(v, copies) for v in obj]
        return obj if all(a is b for a, b in zip(values, obj, strict=True)) else type(obj)(values)
    return obj
