"""What a worker leaves in its attempt's folder for the supervisor, and the supervisor's reading of it: the failure
file of a worker that failed (``rank<N>.json``: its rank, when, the error, its exit code), what the job function
returned on global rank 0 (``RESULT_FILE``), each rank's status file (``env/stop.py``: its last completed iteration,
whether it is saving). Torch-free (a worker pickles tensors with torch already imported)."""

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
from ignite_mgpu.errors import FAILED, ScriptArgumentsError, TrainingStopped, is_user_error
from ignite_mgpu.processes.outcome import Failure

# What the job function returned on global rank 0, beside the failure files.
RESULT_FILE = "result.pkl"


def failure_record(rank: int, err: BaseException, at: float | None = None) -> dict[str, Any]:
    """What a failed worker tells the supervisor in its failure file: its rank, when (``at``: when the job function
    raised; else now), the error, its exit code. Called in the ``except`` block that caught ``err``."""
    return {
        "rank": rank,
        "time": at if at is not None else time.time(),
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


def read_statuses(folder: Path, ranks: list[int] | None = None) -> list[tuple[int, bool]]:
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
