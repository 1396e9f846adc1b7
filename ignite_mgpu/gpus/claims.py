"""GPU claims on a shared machine: a job holds an ``flock`` on each of its GPUs' lock files in one machine-wide
folder, which the kernel releases when the job dies however it dies; beside it, a file of the holder's own says who
holds it (waiting jobs queue in the same folder: ``waiting.py``). Several users write the folder, so nothing read
there is trusted: no symlink is followed, no other user's file is written, and what cannot be read is "an unknown job".
Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import shared_dir
from ignite_mgpu.gpus.shared_dir import printable, user_name

CLAIMS_DIR_ENV = "IGNITE_MGPU_CLAIMS_DIR"  # for servers whose users do not share /tmp
DEFAULT_CLAIMS_DIR = "/tmp/ignite-mgpu-claims"
# A reader's probe holds a shared lock for a moment: a claim retries before it gives up.
_LOCK_TRIES = 5
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


def claims_dir(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(CLAIMS_DIR_ENV) or DEFAULT_CLAIMS_DIR


def claim_name(uuid: str, bus_id: str) -> str:
    """The GPU's name in the folder: its UUID (GPU-8a0e...), else its PCI bus id; only [A-Za-z0-9.-]."""
    name = uuid or f"pci-{bus_id}"
    return re.sub(r"[^A-Za-z0-9.-]", "_", name)[:100]


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


def open_dir(path: str, create: bool) -> int | None:
    """An fd of the claims folder (``shared_dir.open_dir``); None when it does not exist and ``create`` is False.

    Raises:
        ConfigError: not a real folder, or writable by others without the sticky bit (anyone could delete a claim).
    """
    try:
        return shared_dir.open_dir(path, create)
    except shared_dir.UnsafeFolder as err:
        raise _unusable(path, str(err)) from None


def _unusable(path: str, why: str) -> ConfigError:
    return ConfigError(
        f"the GPU claims folder {path} cannot be used: {why}. Every job on GPUs claims its GPUs there, so that two "
        f"jobs never share one by accident. Set {CLAIMS_DIR_ENV} to a folder every user of this machine can write, "
        "made like /tmp (mkdir -m 1777 DIR), or pass --share to run without claims."
    )


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
    elastic = data.get("range")
    elastic = elastic if isinstance(elastic, str) and re.fullmatch(r"\d{1,4}-\d{1,4}", elastic) else ""
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


class GpuClaims:
    """The claims a job holds: open, flocked files, released by ``close`` or when the process dies. The files are
    opened close-on-exec, and a pickled GpuClaims (the plan a spawned worker receives) holds nothing: only the
    launching process holds the job's claims, for the job's whole life, restarts included."""

    def __init__(
        self,
        names: Iterable[str] = (),
        fds: Iterable[int] = (),
        by_name: Mapping[str, list[int]] | None = None,
        since: float | None = None,
    ) -> None:
        self.names = list(names)
        self.since = since if since is not None else time.time()  # when the job claimed its first GPUs
        self._fds = list(fds)
        self._by_name = {name: list(held) for name, held in (by_name or {}).items()}  # its lock file, its holder file

    def release(self, names: Iterable[str]) -> list[str]:
        """Let go of some GPUs' claims while the job goes on (an elastic job leaving out a failed GPU); returns
        those of ``names`` it held."""
        let_go = [name for name in names if name in self.names]
        for name in let_go:
            for fd in reversed(self._by_name.pop(name, [])):  # the holder file first, as in close()
                with contextlib.suppress(OSError, ValueError):
                    self._fds.remove(fd)
                    os.close(fd)
            self.names.remove(name)
        return let_go

    def adopt(self, other: GpuClaims) -> None:
        """Hold ``other``'s claims as this job's own from now on (an elastic job taking more GPUs)."""
        self.names += other.names
        self._fds += other._fds
        self._by_name.update(other._by_name)
        other._fds, other.names, other._by_name = [], [], {}

    def rewrite(self, record: dict[str, object]) -> None:
        """Write ``record`` into the holder file of every GPU held (an elastic job's ``lent``), through the fds that
        hold their locks. Padded to at least the old length, so a reader sees the old or the new JSON whole (JSON
        allows trailing blanks), never a mix cut short."""
        data = json.dumps(record).encode()
        for held in self._by_name.values():
            if len(held) < 2:
                continue  # no holder file was written for it
            with contextlib.suppress(OSError):
                os.pwrite(held[1], data.ljust(os.fstat(held[1]).st_size), 0)

    def __reduce__(self) -> tuple:
        return (GpuClaims, ())

    def close(self) -> None:
        fds, self._fds, self.names, self._by_name = self._fds, [], [], {}
        # The holder files first: a job claiming next finds its own free to write.
        for fd in reversed(fds):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:  # a plan dropped without running its job lets its GPUs go
        with contextlib.suppress(Exception):  # at interpreter exit the kernel closes them anyway
            self.close()

    def __enter__(self) -> GpuClaims:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def claim(dir_fd: int, names: Iterable[str], gpu_range: str = "") -> GpuClaims | None:
    """Claim every GPU of ``names`` or none: locked in sorted order without blocking, and everything taken is let
    go when one is held already (so two jobs can never both win, nor wait on each other). None: one was held.
    ``gpu_range``: an elastic job's ``MIN-MAX`` (``--gpus auto:MIN-MAX``), written for ``ignite-mgpu devices``.

    Raises:
        ConfigError: the claims folder's file system has no flock.
    """
    taken: list[int] = []
    wanted = sorted(set(names))
    try:
        for name in wanted:
            fd = _lock(dir_fd, f"{name}.lock")
            if fd is None:
                for held in taken:
                    os.close(held)
                return None
            taken.append(fd)
    except BaseException:
        for held in taken:
            os.close(held)
        raise
    since = time.time()
    record = json.dumps(holder_record(gpu_range, since=since)).encode()
    by_name = {name: [fd] for name, fd in zip(wanted, taken, strict=True)}
    # Who holds it, for `ignite-mgpu devices` and the messages of other jobs; best effort.
    for name in wanted:
        if (fd := shared_dir.write_own(dir_fd, f"{name}.{os.geteuid()}.holder", record)) is not None:
            taken.append(fd)
            by_name[name].append(fd)
    return GpuClaims(wanted, taken, by_name, since)


def holder_record(gpu_range: str = "", lent: Iterable[str] = (), since: float | None = None) -> dict[str, object]:
    """What a holder file says of this job: its pid, command, since when; an elastic job's range and lent GPUs."""
    about: dict[str, object] = {"pid": os.getpid(), "command": command_line(), "since": since or time.time()}
    return about | ({"range": gpu_range, "lent": sorted(lent)} if gpu_range else {})


def _lock(dir_fd: int, name: str) -> int | None:
    """An fd holding an exclusive flock on the lock file ``name`` (made when missing); None when another job holds
    it, or the file cannot be used (which counts as claimed: a claim is never assumed away)."""
    for _ in range(_LOCK_TRIES):
        opened = shared_dir.open_file(dir_fd, name)
        # Only a missing file is made (another user's is opened above, never truncated)
        if opened is None:
            if (fd := shared_dir.create_file(dir_fd, name, writable=False)) is None:
                continue  # made by another job a moment ago: open that one
        elif isinstance(opened, str):
            return None
        else:
            fd = opened[0]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            time.sleep(0.02)
            continue
        except OSError as err:
            os.close(fd)
            raise ConfigError(
                f"cannot lock GPU claims in {claims_dir()} ({err.strerror}): its file system has no flock. Set "
                f"{CLAIMS_DIR_ENV} to a folder on a local disk (mkdir -m 1777 DIR), or pass --share."
            ) from None
        # Still the file at that name (nobody deleted and remade it)
        with contextlib.suppress(OSError):
            if os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)
    return None


def command_line() -> str:
    """This job's command line as its user typed it, shortened."""
    argv = list(sys.argv) or ["python"]
    if argv[0].endswith(("ignite_mgpu/__main__.py", "-m")):
        argv[0] = "ignite-mgpu"
    else:
        argv[0] = os.path.basename(argv[0])
    return printable(" ".join(argv))


def claim_names(value: object) -> bool:
    """Whether ``value`` is a list of claim names as a job writes them (no more than 64, none longer than 100)."""
    return isinstance(value, list) and len(value) <= 64 and all(isinstance(v, str) and len(v) <= 100 for v in value)
