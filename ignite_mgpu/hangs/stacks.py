"""Every rank's Python stacks, all threads, without stopping it: each worker registers ``faulthandler`` on
``STACKS_SIGNAL`` with a file of its own (``register``); ``dump`` sends the signal and reads what the handler
appended. faulthandler writes from the signal handler itself, without the GIL, so a rank stuck in C code (a
collective, a sleep, a lock) answers too; a stopped (SIGSTOP) rank answers once it continues, and one in the
kernel's uninterruptible sleep not at all (``dump`` then says which).

Torch-free: the supervisor (a hang's report) and ``ignite-mgpu stacks`` (``live_workers``) read them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import socket
import tempfile
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ignite_mgpu.env import launcher_dir
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs.lock import lock_owner

# A real-time signal: no library or script of ours handles it (SIGUSR1/2 may be the pre-emption signal).
STACKS_SIGNAL = signal.SIGRTMIN + 5
_STACK_FILE = re.compile(r"stacks(\d+)-(\d+)\.txt")
_files: list[IO[str]] = []  # the registered files stay open for the life of the worker


@dataclass
class Rank:
    """One worker whose stacks can be asked for: its global rank, pid and faulthandler's file."""

    rank: int
    pid: int
    path: Path


def register(folder: str | Path, rank: int) -> None:
    """In a worker: dump every thread's stack to ``folder/stacks<rank>-<pid>.txt`` on ``STACKS_SIGNAL``.

    The file gets its final name only once the handler is in place, so whoever finds it may signal the process
    (the signal's default action would end it). Appending: each dump lands after the previous one."""
    temporary = Path(folder, f".stacks{rank}")
    file = temporary.open("a")  # kept open: faulthandler writes to it until the worker exits
    faulthandler.register(STACKS_SIGNAL, file=file, all_threads=True, chain=False)
    _files.append(file)
    temporary.rename(Path(folder, f"stacks{rank}-{os.getpid()}.txt"))


def ranks_in(folder: Path) -> list[Rank]:
    """The workers of one attempt that registered (``register``), by rank."""
    found = [(m, p) for p in folder.glob("stacks*-*.txt") if (m := _STACK_FILE.fullmatch(p.name))]
    return sorted((Rank(int(m[1]), int(m[2]), p) for m, p in found), key=lambda r: r.rank)


def _proc(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text(errors="replace")
    except OSError:
        return ""


def catches(pid: int, signum: int = STACKS_SIGNAL) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its /proc status's SigCgt mask): only such a process
    is ever signalled, so a reused pid is never killed by the signal's default action."""
    for line in _proc(pid, "status").splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def state(pid: int) -> str:
    """The process's state letter (R, S, D, T, Z ...; "" when it is gone), from /proc/<pid>/stat."""
    stat = _proc(pid, "stat")
    return stat.rpartition(")")[2].split()[0] if ")" in stat else ""


def loader_children(pid: int) -> list[int]:
    """The children of ``pid`` that inherited its stack handler: its data-loader workers, forked from it."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children += [int(child) for child in _proc(pid, f"task/{task.name}/children").split()]
    return [child for child in children if catches(child)]


def _signal_and_read(
    targets: list[tuple[int, Path]], wait: float, resume: AbstractSet[int] = frozenset()
) -> dict[int, str]:
    """Signal every pid, then read what each appended to its file; "" where nothing came within ``wait``.
    ``resume``: stopped pids, continued after the signal (which they handle first, where they were stopped)."""
    start = {}
    for pid, path in targets:
        with contextlib.suppress(OSError):
            start[pid] = path.stat().st_size
            os.kill(pid, STACKS_SIGNAL)
            if pid in resume:
                os.kill(pid, signal.SIGCONT)
    sizes: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        now = time.monotonic()
        for pid, path in targets:
            with contextlib.suppress(OSError):
                size = path.stat().st_size
                if pid in start and size != sizes.get(pid, (start[pid], 0.0))[0]:
                    sizes[pid] = (size, now)
        # Done when every file grew and then stayed the same for 0.1 s (faulthandler writes in one go).
        if len(sizes) == len(start) and all(now - changed > 0.1 for _, changed in sizes.values()):
            break
        time.sleep(0.02)
    texts = {}
    for pid, path in targets:
        texts[pid] = ""
        if pid in sizes:
            with contextlib.suppress(OSError), path.open("rb") as f:
                f.seek(start[pid])
                texts[pid] = f.read(sizes[pid][0] - start[pid]).decode(errors="replace")
    return texts


def dump(ranks: list[Rank], resume_stopped: bool = False, wait: float = 2.0) -> dict[int, str]:
    """Every rank's stacks now (all threads), then those of its data-loader workers, as text by rank.

    ``resume_stopped``: a stopped (SIGSTOP) rank is continued so that it can answer (done only before the job is
    killed); otherwise its text says that it is stopped."""
    alive = [r for r in ranks if catches(r.pid)]
    stopped = {r.pid for r in alive if state(r.pid) in ("T", "t")}
    asked = [r for r in alive if resume_stopped or r.pid not in stopped]
    texts = _signal_and_read([(r.pid, r.path) for r in asked], wait, stopped if resume_stopped else set())
    out = {}
    for r in ranks:
        text = texts.get(r.pid, "")
        if r.pid in stopped:
            later = "" if resume_stopped else "; no stack until it continues"
            text = f"(process {r.pid} was stopped (SIGSTOP, state T){later})\n{text}"
        elif not text:
            text = _silent(r.pid)
        # One at a time: the loader workers write into their rank's file.
        for child in loader_children(r.pid) if texts.get(r.pid) else []:
            child_text = _signal_and_read([(child, r.path)], wait / 2)[child]
            text += f"\n-- data-loader worker, pid {child} --\n{child_text or _silent(child)}"
        out[r.rank] = text
    return out


def _silent(pid: int) -> str:
    letter = state(pid)
    if not letter or letter == "Z":
        return f"(process {pid} has exited)\n"
    if letter in ("T", "t"):
        return f"(process {pid} was stopped (SIGSTOP, state T) before it answered)\n"
    if letter == "D":
        wchan = _proc(pid, "wchan").strip()
        return f"(process {pid} did not answer: it is in uninterruptible sleep in the kernel ({wchan or '?'}): I/O)\n"
    return f"(process {pid} did not answer within the wait: state {letter})\n"


def launcher_folder(pid: int) -> Path:
    """The private folder of the supervisor in process ``pid`` (its TMPDIR's ``ignite-mgpu-<pid>-*``): one that this
    user owns, private (0700) and held open by ``pid`` (``launcher_dir.why_untrusted``); anyone can make a folder of
    that name in a shared temporary folder, and its files would name the processes to signal."""
    environ = dict(entry.split("=", 1) for entry in _proc(pid, "environ").split("\0") if "=" in entry)
    tmp = environ.get("TMPDIR") or tempfile.gettempdir()
    found = sorted(Path(tmp).glob(f"{launcher_dir.PREFIX}{pid}-*"))
    refused = []
    for folder in found:
        why = launcher_dir.why_untrusted(folder, pid)
        if why is None:
            return folder
        refused.append(f"{folder} {why}")
    fix = (
        "give the pid of the ignite-mgpu train or run command (the launcher), or the run folder of a train job, and "
        "run `ignite-mgpu stacks` as the user who started it, on its machine."
    )
    if refused:
        raise ConfigError(
            f"process {pid} runs no job of ignite-mgpu that this user can trust: {'; '.join(refused[:3])}. Nothing "
            f"was signalled; {fix}"
        )
    raise ConfigError(
        f"process {pid} runs no job of ignite-mgpu that this user can see (no {tmp}/{launcher_dir.PREFIX}{pid}-* "
        f"folder): {fix}"
    )


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is a descendant of ``ancestor`` (its parent's parent's ... is), from /proc."""
    seen = 0
    while pid > 1 and seen < 64:
        stat = _proc(pid, "stat")
        fields = stat.rpartition(")")[2].split()
        if len(fields) < 2:
            return False
        pid, seen = int(fields[1]), seen + 1
        if pid == ancestor:
            return True
    return False


def _target_pid(target: str) -> int:
    """The launcher's pid that ``target`` names: itself, or the pid in a run folder's lock."""
    if target.isdigit():
        return int(target)
    path = Path(target)
    if not path.exists() or not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        raise ConfigError(
            f"{target} {what}. Give the run folder of a train job that runs now, here, or the pid of its launcher "
            "(the ignite-mgpu train or run command; `ignite-mgpu run` jobs have no run folder)."
        )
    owner = lock_owner(path)
    match = re.fullmatch(r"pid (\d+) on host (\S+)", owner or "")
    if match is None or match[2] != socket.gethostname():
        where = f"is held by {owner}" if owner else "is held by no running job"
        raise ConfigError(
            f"{target} holds no live job on this machine: its lock {where}. Give the run folder of a train job "
            "that runs now, here, or the pid of its launcher (the ignite-mgpu train or run command; `ignite-mgpu "
            "run` jobs have no run folder)."
        )
    return int(match[1])


def live_ranks(target: str) -> list[Rank]:
    """The registered ranks of the live job that ``target`` names: a run folder (its lock names the launcher)
    or the launcher's pid; only the launcher's own descendants (a pid in a file name is never trusted alone).
    Raises ConfigError (one paragraph) when it names none."""
    pid = _target_pid(target)
    folder = launcher_folder(pid)
    attempts = sorted(folder.glob("attempt*"), key=lambda p: int(p.name[len("attempt") :] or 0))
    ranks = [r for r in ranks_in(attempts[-1]) if descends_from(r.pid, pid)] if attempts else []
    if not ranks:
        raise ConfigError(
            f"the job of process {pid} has no worker that can be asked for its stacks yet (it is starting, or it "
            "runs in the launcher's own process: one process, or under torchrun/srun). Try again once its workers "
            "run, or use py-spy dump --pid on the process itself."
        )
    return ranks


def format_dumps(texts: dict[int, str]) -> str:
    """Every rank's stacks, one section each, rank order."""
    return "\n".join(f"=== rank {rank} ===\n{text.rstrip()}\n" for rank, text in sorted(texts.items()))
