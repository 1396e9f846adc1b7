"""What a job started by ignite-mgpu shares with one that torchrun started, beyond the ranks: the run's id
(``TORCHELASTIC_RUN_ID``, whose presence is ``torch.distributed.is_torchelastic_launched()``, which Lightning reads to
pick its cluster environment) and each rank's error file (``TORCHELASTIC_ERROR_FILE``), which torch's
``@record`` (``torch.distributed.elastic.multiprocessing.errors``) fills with an uncaught error and its traceback,
and which the failure report then reads, as torchrun's does. Torch-free."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ignite_mgpu.env import cluster
from ignite_mgpu.errors import FAILED

# Beside the workers' own failure files (rank<N>.json) in each attempt's folder.
ERROR_FILE = "error{rank}.json"
# 4 MiB at most: a traceback, never a log.
_MAX_READ = 4 << 20


def run_id(environ: Mapping[str, str], nnodes: int) -> str:
    """The job's ``TORCHELASTIC_RUN_ID``: the scheduler's job id (SLURM_JOB_ID) when there is one, shared by every
    node and every requeue; else one of its own on one node (as ``torchrun --standalone``), and on several nodes
    ``"none"``, which torchrun without ``--rdzv-id`` gives too (each node's launcher would pick another)."""
    found = cluster.job_id(environ)
    if found is not None:
        return found
    return uuid.uuid4().hex if nnodes == 1 else "none"


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
        text, traceback, stamp = body, "", data.get("timestamp", 0)
    elif isinstance(body, dict):
        info = body.get("extraInfo")
        extra: dict[str, Any] = info if isinstance(info, dict) else {}
        text, traceback = str(body.get("message", "")), str(extra.get("py_callstack", ""))
        stamp = extra.get("timestamp")
    else:
        return None
    kind, sep, message = text.partition(": ")
    if not sep or not kind.replace(".", "").replace("_", "").isalnum():
        kind, message = "Error", text
    found: dict[str, Any] = {"type": kind, "message": message, "traceback": traceback}
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
