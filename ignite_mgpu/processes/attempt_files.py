"""What a worker leaves in its attempt's folder for the supervisor, and the supervisor's reading of it: the failure
file of a worker that failed (``rank<N>.json``: its rank, when, the error, its exit code), what the job function
returned on global rank 0 (``RESULT_FILE``), each rank's status file (``env/stop.py``: its last completed iteration,
whether it is saving), and each rank's error file (``TORCHELASTIC_ERROR_FILE``), which torch's ``@record``
(``torch.distributed.elastic.multiprocessing.errors``) fills with an uncaught error and its traceback, as under
torchrun, and which the failure report reads as torchrun's does. Torch-free (a worker pickles tensors with torch
already imported)."""

from __future__ import annotations

import contextlib
import json
import pickle
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ignite_mgpu.env import stop
from ignite_mgpu.env.stop import Status
from ignite_mgpu.errors import FAILED, ScriptArgumentsError, TrainingStopped, is_user_error
from ignite_mgpu.processes.outcome import Failure

# What the job function returned on global rank 0, beside the failure files.
RESULT_FILE = "result.pkl"
# The attribute that carries when an error left the job's function (mark_raised).
_RAISED_AT = "_ignite_mgpu_raised_at"
# What @record writes, beside the workers' own failure files.
ERROR_FILE = "error{rank}.json"
# 4 MiB at most: a traceback, never a log.
_MAX_READ = 4 << 20


def mark_raised(err: BaseException) -> None:
    """Note on ``err`` when it left the job's function, where its time is first known (the innermost job when one
    runs inside another: ``launch()`` in a script under ``ignite-mgpu run``). Leaving ``idist.Parallel`` then
    destroys the process group and the peers fail on it at once: this time names this rank's error as the cause."""
    if getattr(err, _RAISED_AT, None) is None:
        with contextlib.suppress(AttributeError, TypeError):  # an exception class with __slots__
            setattr(err, _RAISED_AT, time.time())


def failure_record(rank: int, err: BaseException) -> dict[str, Any]:
    """What a failed worker tells the supervisor in its failure file: its rank, when (when the job's function
    raised, ``mark_raised``; else now), the error, its exit code. Called in the ``except`` block that caught
    ``err``."""
    at = getattr(err, _RAISED_AT, None)
    return {
        "rank": rank,
        "time": at if isinstance(at, float) else time.time(),
        "type": type(err).__name__,
        "message": str(err),
        "traceback": getattr(err, "detail", "") if is_user_error(err) else traceback.format_exc(),
        "code": err.exit_code if isinstance(err, (TrainingStopped, ScriptArgumentsError)) else FAILED,
        "user_error": is_user_error(err),  # a restart would meet it again
    }


def write_result(path: Path, value: Any) -> None:
    """Pickle what the job function returned on global rank 0 for the supervisor; tensors go to the CPU (the
    launching process must not initialise CUDA to read them: a notebook could not fork workers again)."""
    torch = sys.modules.get("torch")

    class ToCpu(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            return NotImplemented

    try:
        with path.open("wb") as f:
            ToCpu(f, pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as err:
        raise TypeError(
            f"the job function returned a {type(value).__name__} on rank 0 that cannot be pickled ({err}), so it "
            "cannot reach the launching process. Return plain data (numbers, strings, lists, dicts, tensors, a "
            "state_dict), or save the object to a file and return its path."
        ) from None


def read_statuses(folder: Path, ranks: list[int] | None = None) -> list[Status]:
    """The status of every worker (or of the global ``ranks``) that wrote one."""
    files = folder.glob("status*") if ranks is None else (folder / f"status{rank}" for rank in ranks)
    found = (stop.read_status(f) for f in files)
    return [s for s in found if s is not None]


def read_value(folder: Path) -> Any:
    """What ``fn`` returned on global rank 0 (written by its worker; None where it returned nothing)."""
    path = folder / RESULT_FILE
    return pickle.loads(path.read_bytes()) if path.is_file() else None


def read_failures(folder: Path) -> list[Failure]:
    """The failure files of the attempt's workers (one that cannot be read or parsed is left out)."""
    failures = []
    for f in folder.glob("rank*.json"):
        with contextlib.suppress(ValueError, OSError):
            failures.append(json.loads(f.read_text()))
    return failures


def error_file(folder: str | Path, rank: int) -> str:
    """Global rank ``rank``'s error file in the attempt's ``folder`` (written by ``@record``, if at all)."""
    return str(Path(folder, ERROR_FILE.format(rank=rank)))


def read_error_file(path: Path) -> dict[str, Any] | None:
    """The error that ``@record`` wrote to ``path`` as a failure file's fields (type, message, traceback, time), or
    None when there is none (the script does not use ``@record``, or did not fail) or it cannot be read.

    torch writes ``{"message": {"message": "ValueError: ...", "extraInfo": {"py_callstack": ..., "timestamp":
    ...}}}``; a message that is a plain string (torch's other format, a child's dumped error) is taken as it is.
    """
    try:
        with path.open() as f:
            data = json.loads(f.read(_MAX_READ))
        body = data["message"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if isinstance(body, str):
        text, callstack, stamp = body, "", data.get("timestamp", 0)
    elif isinstance(body, dict):
        info = body.get("extraInfo")
        extra: dict[str, Any] = info if isinstance(info, dict) else {}
        text, callstack = str(body.get("message", "")), str(extra.get("py_callstack", ""))
        stamp = extra.get("timestamp")
    else:
        return None
    kind, sep, message = text.partition(": ")
    if not sep or not kind.replace(".", "").replace("_", "").isalnum():
        kind, message = "Error", text
    found: dict[str, Any] = {"type": kind, "message": message, "traceback": callstack}
    try:
        found["time"] = float(stamp)
    except (TypeError, ValueError):
        pass
    return found


def with_error_files(failures: list[dict[str, Any]], folder: Path, failed_ranks: list[int]) -> list[dict[str, Any]]:
    """The workers' failure files, each failed rank's error as its error file tells it where ``@record`` wrote one
    (torchrun's report shows that file's error and traceback): the script's own error where the worker saw only
    its exit (``sys.exit(1)`` after the error, ``os._exit``). The time stays the worker's own where it wrote one
    (the file's is in whole seconds)."""
    by_rank = {f["rank"]: f for f in failures}
    for rank in failed_ranks:
        recorded = read_error_file(folder / ERROR_FILE.format(rank=rank))
        if recorded is None:
            continue
        own = by_rank.get(rank)
        if own is None:
            by_rank[rank] = {"rank": rank, "code": FAILED, "user_error": False, "time": 0.0, **recorded}
        elif own.get("code") == FAILED and not own.get("user_error"):
            by_rank[rank] = {**own, **recorded, "time": own["time"]}
    return list(by_rank.values())
