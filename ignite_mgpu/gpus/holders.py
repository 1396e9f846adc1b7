"""Who holds a GPU claim, as far as the claims folder tells (``claims.py`` takes them): each claimed GPU's live
holder file, owned by its user and locked, read without trusting it (no symlink, 4 KiB at most, every field
checked); a claim whose holder file cannot be read is "an unknown job". Read by ``devices``, the waiting line, the
lenders and the messages of a job that finds its GPUs taken. Torch-free."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ignite_mgpu.gpus import shared_dir
from ignite_mgpu.gpus.ranges import written_range
from ignite_mgpu.gpus.shared_dir import printable
from ignite_mgpu.text import user_name

_NO_HOLDER = "it wrote no readable holder file"


@dataclass(frozen=True)
class Holder:
    """Who holds a claim (or waits in the queue), as far as the folder tells. ``user`` comes from the file's owner,
    never from its content; ``known`` is False when the claim exists but its holder file cannot be read."""

    user: str = "?"
    pid: int | None = None
    command: str = ""
    since: float | None = None  # time.time() when the claim (or the wait) began
    known: bool = False
    # Why the claim is not readable, e.g. "a symlink where the lock file should be"
    problem: str = ""
    gpu_range: str = ""  # an elastic job's "MIN-MAX" (--gpus auto:MIN-MAX), else ""
    # An elastic job's GPUs (claim names) lent to jobs waiting in line: being let go, or held by a waiter now.
    lent: tuple[str, ...] = ()

    def describe(self) -> str:
        """ "alice (pid 4242, `ignite-mgpu train --gpus 2`, since 2026-12-01 16:05:12)", or the unknown job."""
        if not self.known:
            return f"an unknown job ({self.problem})" if self.problem else "an unknown job"
        parts = [f"pid {self.pid}"] if self.pid is not None else []
        parts += [f"`{self.command}`"] if self.command else []
        parts += [f"since {format_time(self.since)}"] if self.since is not None else []
        return f"{self.user} ({', '.join(parts)})" if parts else self.user

    def as_json(self) -> dict[str, object]:
        since = None if self.since is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.since))
        return {
            "user": self.user if self.known else None,
            "pid": self.pid,
            "command": self.command or None,
            "since": since,
            "known": self.known,
            "range": self.gpu_range or None,
            "lent": list(self.lent) if self.gpu_range else None,
        }


def format_time(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def process_user(pid: int) -> str | None:
    """The user running ``pid`` (its real uid in /proc/<pid>/status), or None when this machine cannot see it
    (a process of another container, or gone)."""
    try:
        with open(f"/proc/{int(pid)}/status", "rb") as f:
            text = f.read(shared_dir.MAX_READ).decode(errors="replace")
    except (OSError, ValueError):
        return None
    m = re.search(r"^Uid:\s+(\d+)", text, re.MULTILINE)
    return user_name(int(m[1])) if m else None


def _holder_from(data: dict | None, owner: int) -> Holder:
    if data is None:
        return Holder(user_name(owner), problem="its holder file is unreadable")
    pid, command, since = data.get("pid"), data.get("command"), data.get("since")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        pid = None
    # Anyone may write a holder file: nan, inf or 1e300 are no time of a claim.
    if not isinstance(since, (int, float)) or isinstance(since, bool) or not 0 < since < 1e11:
        since = None
    text = printable(command) if isinstance(command, str) else ""
    elastic = written_range(data.get("range"))  # the --gpus grammar's own check
    lent = data.get("lent")
    lent_names = tuple(lent) if elastic and isinstance(lent, list) and claim_names(lent) else ()
    when = None if since is None else float(since)
    return Holder(user_name(owner), pid, text, when, True, gpu_range=elastic, lent=lent_names)


def holders(dir_fd: int | None, names: Iterable[str]) -> dict[str, Holder]:
    """The claimed GPUs among ``names`` (``claim_name``) and who holds each; unclaimed ones are absent."""
    if dir_fd is None:
        return {}
    found: dict[str, Holder] = {}
    entries: list[str] | None = None
    for name in names:
        opened = shared_dir.open_file(dir_fd, f"{name}.lock")
        if isinstance(opened, str):
            found[name] = Holder(problem=opened)
            continue
        if opened is None:
            continue
        fd = opened[0]
        try:
            locked = shared_dir.is_locked(fd)
        finally:
            os.close(fd)
        if locked:
            entries = shared_dir.entries(dir_fd, _is_holder) if entries is None else entries
            found[name] = _find_holder(dir_fd, name, entries)
            if found[name].problem == _NO_HOLDER:
                time.sleep(0.05)  # claimed a moment ago: its holder file follows the lock
                found[name] = _find_holder(dir_fd, name, shared_dir.entries(dir_fd, _is_holder))
    return found


def _is_holder(name: str) -> bool:
    return name.endswith(".holder")


def _find_holder(dir_fd: int, name: str, entries: list[str]) -> Holder:
    """The live holder file of a claimed GPU: ``<name>.<uid>.holder``, owned by that uid and locked."""
    pattern = re.compile(re.escape(name) + r"\.(\d{1,10})\.holder")
    for entry in entries:
        if not (m := pattern.fullmatch(entry)):
            continue
        opened = shared_dir.open_file(dir_fd, entry)
        if not isinstance(opened, tuple):
            continue
        fd, st = opened
        try:
            if st.st_uid == int(m[1]) and shared_dir.is_locked(fd):
                return _holder_from(shared_dir.read_json(fd), st.st_uid)
        finally:
            os.close(fd)
    return Holder(problem=_NO_HOLDER)


def claim_names(value: object) -> bool:
    """Whether ``value`` is a list of claim names as a job writes them (no more than 64, none longer than 100)."""
    return isinstance(value, list) and len(value) <= 64 and all(isinstance(v, str) and len(v) <= 100 for v in value)
