"""A hang's report: where each rank is, read from its stacks (``stacks.dump``), in a few lines of the failure
report, and every rank's full stacks in ``hang_<time>.txt``. A rank waiting in a collective is told apart from
the rank it waits for; for each, the innermost frame of the user's code (torch's, ignite's, ignite-mgpu's and the
standard library's frames skipped) and the collective it is in (the innermost ``torch.distributed`` call, or a
backward pass, where DDP's gradient all-reduce waits). On NCCL, the Flight Recorder (``flight_recorder_env``) adds
each rank's last collective that did not complete.

Torch-free: the supervisor writes it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import re
import shutil
import sysconfig
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ignite_mgpu.hangs import stacks
from ignite_mgpu.runs.folder import HANG_REPORT
from ignite_mgpu.text import plural

_FRAME = re.compile(r'\s*File "(.*)", line (\d+) in (.*)')
_LOADER = re.compile(r"^-- data-loader worker, pid (\d+) --$", re.MULTILINE)  # stacks.dump's heading
_FR_PREFIX, _FR_PIPE = "nccl_trace_rank_", "nccl_pipe_rank_"
_PENDING = ", not completed"  # a Flight Recorder's collective that this rank waits in


class Frame(NamedTuple):
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


_Dirs = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def _library_dirs() -> _Dirs:
    """(torch's, ignite's and ignite-mgpu's folders, the standard library's, the installed packages')."""
    packages = []
    for name in ("torch", "ignite", "ignite_mgpu"):
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)  # finds without importing
            if spec is not None and spec.origin:
                packages.append(os.path.dirname(spec.origin) + os.sep)
    paths = sysconfig.get_paths()
    stdlib = tuple({paths["stdlib"] + os.sep, paths["platstdlib"] + os.sep})
    return tuple(packages), stdlib, tuple({paths["purelib"] + os.sep, paths["platlib"] + os.sep})


def is_library(file: str, dirs: _Dirs | None = None) -> bool:
    """Whether a frame's file is torch's, ignite's, ignite-mgpu's or the standard library's (not the user's)."""
    packages, stdlib, installed = dirs or _library_dirs()
    if file.startswith("<") or file.startswith(packages):  # <frozen importlib._bootstrap> and the like
        return True
    # The standard library's folder holds site-packages, whose other packages (PIL, the user's) are shown.
    return file.startswith(stdlib) and not file.startswith(installed)


def threads(text: str) -> list[list[Frame]]:
    """The threads of one faulthandler dump, each as its frames, innermost first."""
    found: list[list[Frame]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent")):
            found.append([])
        elif found and (m := _FRAME.match(line)):
            found[-1].append(Frame(m[1], int(m[2]), m[3]))
    return found


def main_thread(text: str) -> list[Frame]:
    """The worker's main thread: the one that runs ``worker_main`` (else the first of the dump)."""
    every = threads(text)
    for frames in every:
        if any(f.function == "worker_main" and f.file.endswith(os.path.join("processes", "worker.py")) for f in frames):
            return frames
    return every[0] if every else []


@dataclass
class Where:
    """Where one rank's main thread is."""

    frame: Frame | None  # the innermost frame of the user's code, else of ignite-mgpu's
    collective: str | None = None  # the collective it waits in ("all_gather"; "backward": DDP's all-reduce)
    called_at: Frame | None = None  # where that collective was called, outside torch and ignite
    loader: tuple[int, Frame] | None = None  # (pid, frame) of a data-loader worker in the user's code


# DDP's constructor: the parameters' shapes checked and the module's state broadcast, with every rank.
_DDP_SET_UP = ("_verify_param_shape_across_processes", "_sync_module_states", "_sync_params_and_buffers")


def where(text: str) -> Where:
    """Where a rank's main thread is, from its dump (``stacks.dump``: the rank's, then its loader workers')."""
    own, *loaders = _LOADER.split(text)
    frames = main_thread(own)
    dirs = _library_dirs()
    own = [f for f in frames if not is_library(f.file, dirs)]
    ours = [f for f in frames if os.sep + "ignite_mgpu" + os.sep in f.file]
    found = Where(own[0] if own else ours[0] if ours else None)
    for i, f in enumerate(frames):
        c10d = f.file.endswith(os.path.join("distributed", "distributed_c10d.py")) and not f.function.startswith("_")
        backward = os.sep + "autograd" + os.sep in f.file and f.function in ("backward", "_engine_run_backward")
        ddp = f.file.endswith(os.path.join("distributed", "utils.py")) and f.function in _DDP_SET_UP
        if c10d or backward or ddp:
            found.collective = f.function if c10d else "backward" if backward else "DDP"
            outside = [g for g in frames[i + 1 :] if not is_library(g.file, dirs) or g in ours]
            found.called_at = outside[0] if outside else None
            break
    if not own_frames(found, dirs):  # waiting for its data: where its loader workers are
        for pid, loader_text in zip(loaders[::2], loaders[1::2], strict=True):
            user = [f for f in (threads(loader_text) or [[]])[0] if not is_library(f.file, dirs)]
            if user:
                found.loader = int(pid), user[0]
                break
    return found


def own_frames(found: Where, dirs: _Dirs) -> bool:
    """Whether the rank itself is in a collective or in the user's code."""
    return found.collective is not None or (found.frame is not None and not is_library(found.frame.file, dirs))


def describe(rank_where: Where) -> str:
    if rank_where.collective == "backward":
        at = f", called at {rank_where.called_at}" if rank_where.called_at else ""
        return f"waits in backward (where DDP's gradient all-reduce waits for the other ranks){at}"
    if rank_where.collective == "DDP":
        at = f", called at {rank_where.called_at}" if rank_where.called_at else ""
        return f"waits in DistributedDataParallel's construction (its parameters checked with every rank){at}"
    if rank_where.collective:
        at = f", called at {rank_where.called_at}" if rank_where.called_at else ""
        return f"waits in the collective {rank_where.collective}{at}"
    if rank_where.loader:
        return f"waits for its data-loader worker (pid {rank_where.loader[0]}), which is in {rank_where.loader[1]}"
    return f"is in {rank_where.frame}" if rank_where.frame else "has no Python frame to show"


@dataclass
class RankInfo:
    """What the report says of a rank beside its stacks."""

    pid: int
    gpu: int | None  # its physical GPU
    iteration: int | None  # its last completed iteration


def summary(texts: dict[int, str], info: dict[int, RankInfo], nccl: dict[int, str]) -> tuple[list[int], list[str]]:
    """(the stuck ranks, one line per rank). Stuck: not waiting in a collective, or (all waiting) every rank."""
    wheres = {rank: where(text) for rank, text in texts.items()}
    # On NCCL a waiting rank's Python thread may be past the collective's call (in a CUDA synchronisation): its
    # Flight Recorder's collective that did not complete says that it waits.
    waiting = {rank for rank, w in wheres.items() if w.collective or _PENDING in nccl.get(rank, "")}
    stuck = [rank for rank in sorted(wheres) if rank not in waiting] or sorted(wheres)
    lines = []
    for rank in sorted(texts):
        facts = [f"pid {info[rank].pid}"] if rank in info else []
        if rank in info and info[rank].gpu is not None:
            facts.append(f"physical GPU {info[rank].gpu}")
        if rank in info and info[rank].iteration is not None:
            facts.append(f"last completed iteration {info[rank].iteration}")
        state = texts[rank].splitlines()[0] if texts[rank].startswith("(") else ""
        line = f"  rank {rank} ({', '.join(facts)}) {describe(wheres[rank])}{' ' + state if state else ''}"
        lines.append(line + (f"; NCCL Flight Recorder: {nccl[rank]}" if rank in nccl else ""))
    return stuck, lines + mismatch(wheres)


def mismatch(wheres: Mapping[int, Where]) -> list[str]:
    """A line when every rank waits in a collective but not all in the same one: their calls do not match."""
    called = {w.collective for w in wheres.values()}
    if len(wheres) < 2 or None in called or len(called) < 2:
        return []
    return [
        f"  the ranks wait in different collectives ({', '.join(sorted(str(c) for c in called))}): their calls do not "
        "match (a branch that depends on the rank, or ranks running different numbers of forwards); "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL names the first mismatch as it happens, for a debugging run"
    ]


def write_report(folder: Path, header: str, lines: list[str], texts: dict[int, str], nccl_dir: Path | None) -> Path:
    """``hang_<time>.txt`` in ``folder``: the summary, then every rank's full stacks; the Flight Recorder's dumps
    beside it (``nccl_trace_<time>/``, read by ``python -m torch.distributed.flight_recorder.fr_trace``)."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    path = folder / HANG_REPORT.format(stamp)
    folder.mkdir(parents=True, exist_ok=True)
    body = [header, *lines, ""]
    dumps = sorted(nccl_dir.glob(f"{_FR_PREFIX}*")) if nccl_dir is not None else []
    if dumps:
        saved = folder / f"nccl_trace_{stamp}"
        saved.mkdir(exist_ok=True)
        for dump_file in dumps:
            shutil.copy(dump_file, saved / dump_file.name)
        body.append(
            f"NCCL Flight Recorder dumps: {saved} (python -m torch.distributed.flight_recorder.fr_trace {saved})"
        )
    body += [f"=== rank {rank} ===\n{text.rstrip()}\n" for rank, text in sorted(texts.items())]
    path.write_text("\n".join(body))
    return path


def flight_recorder_env(folder: str | Path) -> dict[str, str]:
    """The NCCL Flight Recorder's variables for an nccl job's workers: a trace of the last 2000 collectives,
    dumped into ``folder`` on a collective timeout or when the supervisor asks (``ask_flight_recorder``)."""
    trace, pipe = str(Path(folder, _FR_PREFIX)), str(Path(folder, _FR_PIPE))
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace,  # before PyTorch 2.7: the dump's file
        "TORCH_FR_DUMP_TEMP_FILE": trace,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": pipe,  # writing to <pipe><rank>.pipe asks for a dump
    }


def prepare_worker(folder: str | Path, rank: int, backend: str | None) -> None:
    """In a worker: its stacks on request (``stacks.register``, for a hang's report and ``ignite-mgpu stacks``);
    on nccl, the Flight Recorder's variables, where the user set none."""
    stacks.register(folder, rank)
    if backend == "nccl":
        os.environ.update({**flight_recorder_env(folder), **os.environ})


def ask_flight_recorder(folder: Path, ranks: list[int], wait: float = 3.0) -> None:
    """Ask every rank's Flight Recorder for a dump now (its pipe) and wait for the files, up to ``wait`` s."""
    asked = []
    for rank in ranks:
        with contextlib.suppress(OSError):
            fd = os.open(folder / f"{_FR_PIPE}{rank}.pipe", os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"1")
            os.close(fd)
            asked.append(folder / f"{_FR_PREFIX}{rank}")
    deadline = time.monotonic() + wait
    while asked and time.monotonic() < deadline and not all(p.exists() for p in asked):
        time.sleep(0.1)


def flight_recorder(folder: Path) -> dict[int, str]:
    """Each rank's oldest collective that did not complete, from the Flight Recorder's dumps in ``folder``."""
    found = {}
    for path in folder.glob(f"{_FR_PREFIX}*"):
        with contextlib.suppress(Exception):  # a dump being written, or of another format: nothing to say
            rank = int(path.name[len(_FR_PREFIX) :])
            # Our own workers' dump, in this process's private folder (as torch's fr_trace reads it).
            entries: list[dict[str, Any]] = pickle.loads(path.read_bytes())["entries"]
            pending = [e for e in entries if e.get("state") != "completed"]
            if pending:
                e = pending[0]
                found[rank] = (
                    f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} "
                    f"(process group {e.get('pg_id', '?')}) {e.get('state', '?')}{_PENDING}"
                )
            else:
                found[rank] = f"every one of its last {plural(len(entries), 'collective')} completed"
    return found


@dataclass
class Hang:
    """What the supervisor found of a hang: the stuck ranks, one line each, the report's file."""

    stuck: list[int]
    lines: list[str]
    path: Path
    cause: str | None = None  # the hang watch's finding (None: found by a timeout, a stop not answered)


def collect(
    folder: Path,
    report_dir: Path,
    why: str,
    iterations: Mapping[int, int],
    gpus: Mapping[int, int],
    nccl: bool = False,
    cause: str | None = None,
    behind: Sequence[int] = (),
) -> Hang:
    """Every rank's stacks now (a stopped rank is continued so that it answers: the job is killed next), the
    Flight Recorder's dumps on ``nccl``, and the report written to ``report_dir`` (the run folder). ``folder``: the
    attempt's; ``iterations`` and ``gpus``: each global rank's last completed iteration and physical GPU, where
    known; ``why``: the report's first line; ``cause``: the hang watch's finding, the job's cause; ``behind``: the
    ranks it found behind the others before the first iteration (the stuck ones, whatever their stacks show)."""
    ranks = stacks.ranks_in(folder)
    if nccl:
        ask_flight_recorder(folder, [r.rank for r in ranks])
    texts = stacks.dump(ranks, resume_stopped=True)
    info = {r.rank: RankInfo(r.pid, gpus.get(r.rank), iterations.get(r.rank)) for r in ranks}
    stuck, lines = summary(texts, info, flight_recorder(folder))
    path = write_report(report_dir, why, lines, texts, folder)
    return Hang(list(behind) or stuck, lines, path, cause)
