"""GPU claims on a shared machine: a job holds an ``flock`` on each of its GPUs' lock files in one machine-wide
folder, which the kernel releases when the job dies however it dies; beside it, a file of the holder's own says who
holds it, and waiting jobs queue with a ticket file each. Several users write the folder, so nothing read there is
trusted: no symlink is followed, no other user's file is written, and what cannot be read is "an unknown job".
Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import stat
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ignite_mgpu.errors import ConfigError

CLAIMS_DIR_ENV = "IGNITE_MGPU_CLAIMS_DIR"  # for servers whose users do not share /tmp
DEFAULT_CLAIMS_DIR = "/tmp/ignite-mgpu-claims"
_MAX_READ = 4096  # bytes read of any file in the folder: a huge file costs no more than a small one
_MAX_ENTRIES = 10_000  # folder entries looked at when searching holders and tickets
_LOCK_TRIES = 5  # a reader's probe holds a shared lock for a moment: a claim retries before it gives up
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # O_NONBLOCK: a FIFO never blocks open
_NO_HOLDER = "it wrote no readable holder file"
_TICKET = re.compile(r"wait-(\d{1,20})-(\d{1,10})-(\d{1,10})")  # wait-<start ns>-<pid>-<uid>


@dataclass(frozen=True)
class Holder:
    """Who holds a claim (or waits in the queue), as far as the folder tells. ``user`` comes from the file's owner,
    never from its content; ``known`` is False when the claim exists but its holder file cannot be read."""

    user: str = "?"
    pid: int | None = None
    command: str = ""
    since: float | None = None  # time.time() when the claim (or the wait) began
    known: bool = False
    problem: str = ""  # why the claim is not readable, e.g. "a symlink where the lock file should be"

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
        return {"user": self.user if self.known else None, "pid": self.pid, "command": self.command or None,
                "since": since, "known": self.known}  # fmt: skip


def format_time(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def claims_dir(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(CLAIMS_DIR_ENV) or DEFAULT_CLAIMS_DIR


def claim_name(uuid: str, bus_id: str) -> str:
    """The GPU's name in the folder: its UUID (GPU-8a0e...), else its PCI bus id; only [A-Za-z0-9.-]."""
    name = uuid or f"pci-{bus_id}"
    return re.sub(r"[^A-Za-z0-9.-]", "_", name)[:100]


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return f"uid {uid}"


def process_user(pid: int) -> str | None:
    """The user running ``pid`` (its real uid in /proc/<pid>/status), or None when this machine cannot see it
    (a process of another container, or gone)."""
    try:
        with open(f"/proc/{int(pid)}/status", "rb") as f:
            text = f.read(_MAX_READ).decode(errors="replace")
    except (OSError, ValueError):
        return None
    m = re.search(r"^Uid:\s+(\d+)", text, re.MULTILINE)
    return _user(int(m[1])) if m else None


def _printable(text: str, limit: int = 200) -> str:
    """Untrusted text made safe for a terminal: no control characters (escape sequences), at most ``limit``."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def open_dir(path: str, create: bool) -> int | None:
    """An fd of the claims folder (every later open is relative to it, so a swapped path cannot redirect them).
    None when it does not exist and ``create`` is False.

    Raises:
        ConfigError: not a real folder, or writable by others without the sticky bit (anyone could delete a claim).
    """
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o1777)
            with contextlib.suppress(OSError):  # the umask took bits off; a folder made by another user stays
                os.chmod(path, 0o1777, follow_symlinks=False)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            return None
        raise _unusable(path, "it does not exist and cannot be made") from None
    except OSError as err:
        why = "it is a symlink, which is never followed" if os.path.islink(path) else (err.strerror or str(err))
        raise _unusable(path, why) from None
    mode = os.fstat(fd).st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        os.close(fd)
        raise _unusable(path, "it is writable by other users but not sticky, so any of them could delete a claim")
    return fd


def _unusable(path: str, why: str) -> ConfigError:
    return ConfigError(
        f"the GPU claims folder {path} cannot be used: {why}. Every job on GPUs claims its GPUs there, so that two "
        f"jobs never share one by accident. Set {CLAIMS_DIR_ENV} to a folder every user of this machine can write, "
        "made like /tmp (mkdir -m 1777 DIR), or pass --share to run without claims."
    )


def _open_file(dir_fd: int, name: str, writable: bool = False) -> tuple[int, os.stat_result] | str | None:
    """(fd, fstat) of a regular file; None when it does not exist; else why it cannot be used."""
    try:
        fd = os.open(name, (os.O_RDWR if writable else os.O_RDONLY) | _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{name} in the claims folder is a symlink, which is never followed"
        return f"{name} in the claims folder cannot be opened ({err.strerror})"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return f"{name} in the claims folder is not a regular file"
    return fd, st


def _is_locked(fd: int) -> bool | None:
    """Whether another open file holds an flock on it; None when this file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _read_json(fd: int) -> dict | None:
    try:
        value = json.loads(os.pread(fd, _MAX_READ, 0).decode("utf-8"))
    except Exception:  # garbage, truncated, too deeply nested: an unknown holder, never a crash
        return None
    return value if isinstance(value, dict) else None


def _holder_from(data: dict | None, owner: int) -> Holder:
    if data is None:
        return Holder(_user(owner), problem="its holder file is unreadable")
    pid, command, since = data.get("pid"), data.get("command"), data.get("since")
    good_since = type(since) in (int, float) and 0 < since < 1e11  # type: ignore[operator]  # a number: checked
    return Holder(
        _user(owner),
        pid if type(pid) is int and 0 < pid < 2**31 else None,
        _printable(command) if isinstance(command, str) else "",
        float(since) if good_since else None,  # type: ignore[arg-type]  # a number: checked
        known=True,
    )


def _entries(dir_fd: int) -> list[str]:
    try:
        return sorted(os.listdir(dir_fd))[:_MAX_ENTRIES]
    except OSError:
        return []


def holders(dir_fd: int | None, names: Iterable[str]) -> dict[str, Holder]:
    """The claimed GPUs among ``names`` (``claim_name``) and who holds each; unclaimed ones are absent."""
    if dir_fd is None:
        return {}
    found: dict[str, Holder] = {}
    entries: list[str] | None = None
    for name in names:
        opened = _open_file(dir_fd, f"{name}.lock")
        if isinstance(opened, str):
            found[name] = Holder(problem=opened)
            continue
        if opened is None:
            continue
        fd = opened[0]
        try:
            locked = _is_locked(fd)
        finally:
            os.close(fd)
        if locked:
            entries = _entries(dir_fd) if entries is None else entries
            found[name] = _find_holder(dir_fd, name, entries)
            if found[name].problem == _NO_HOLDER:
                time.sleep(0.05)  # claimed a moment ago: its holder file follows the lock
                found[name] = _find_holder(dir_fd, name, _entries(dir_fd))
    return found


def _find_holder(dir_fd: int, name: str, entries: list[str]) -> Holder:
    """The live holder file of a claimed GPU: ``<name>.<uid>.holder``, owned by that uid and locked."""
    pattern = re.compile(re.escape(name) + r"\.(\d{1,10})\.holder")
    for entry in entries:
        if not (m := pattern.fullmatch(entry)):
            continue
        opened = _open_file(dir_fd, entry)
        if not isinstance(opened, tuple):
            continue
        fd, st = opened
        try:
            if st.st_uid == int(m[1]) and _is_locked(fd):
                return _holder_from(_read_json(fd), st.st_uid)
        finally:
            os.close(fd)
    return Holder(problem=_NO_HOLDER)


class GpuClaims:
    """The claims a job holds: open, flocked files, released by ``close`` or when the process dies. The files are
    opened close-on-exec, and a pickled GpuClaims (the plan a spawned worker receives) holds nothing: only the
    launching process holds the job's claims, for the job's whole life, restarts included."""

    def __init__(self, names: Iterable[str] = (), fds: Iterable[int] = ()) -> None:
        self.names = list(names)
        self._fds = list(fds)

    def __reduce__(self) -> tuple:
        return (GpuClaims, ())

    def close(self) -> None:
        fds, self._fds, self.names = self._fds, [], []
        for fd in reversed(fds):  # the holder files first: a job claiming next finds its own free to write
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:  # a plan dropped without running its job lets its GPUs go
        with contextlib.suppress(Exception):  # at interpreter exit the kernel closes them anyway
            self.close()

    def __enter__(self) -> GpuClaims:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def claim(dir_fd: int, names: Iterable[str]) -> GpuClaims | None:
    """Claim every GPU of ``names`` or none: locked in sorted order without blocking, and everything taken is let
    go when one is held already (so two jobs can never both win, nor wait on each other). None: one was held.

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
    record = json.dumps({"pid": os.getpid(), "command": _command(), "since": time.time()}).encode()
    for name in wanted:  # who holds it, for `ignite-mgpu devices` and the messages of other jobs; best effort
        if (fd := _write_own(dir_fd, f"{name}.{os.geteuid()}.holder", record)) is not None:
            taken.append(fd)
    return GpuClaims(wanted, taken)


def _lock(dir_fd: int, name: str) -> int | None:
    """An fd holding an exclusive flock on the lock file ``name`` (made when missing); None when another job holds
    it, or the file cannot be used (which counts as claimed: a claim is never assumed away)."""
    for _ in range(_LOCK_TRIES):
        opened = _open_file(dir_fd, name)
        if opened is None:
            try:  # the other user's file is opened above; only a missing one is made, never truncated
                fd = os.open(name, os.O_RDONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o644, dir_fd=dir_fd)
                os.fchmod(fd, 0o644)  # readable by all, so every user can flock it
            except FileExistsError:
                continue
            except OSError:
                return None
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
        with contextlib.suppress(OSError):  # still the file at that name (nobody deleted and remade it)
            if os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)
    return None


def _write_own(dir_fd: int, name: str, data: bytes) -> int | None:
    """Write ``data`` into this user's file ``name`` and hold an flock on it; None (nothing written) when the
    name is taken by something that is not this user's regular file."""
    opened = _open_file(dir_fd, name, writable=True)
    if opened is None:
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o644, dir_fd=dir_fd)
            os.fchmod(fd, 0o644)
        except OSError:
            return None
    elif isinstance(opened, str) or opened[1].st_uid != os.geteuid():
        if isinstance(opened, tuple):
            os.close(opened[0])  # another user's file (root could write it): never written
        return None
    else:
        fd = opened[0]
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        os.close(fd)
        return None
    return fd


def _command() -> str:
    """This job's command line as its user typed it, shortened."""
    argv = list(sys.argv) or ["python"]
    if argv[0].endswith(("ignite_mgpu/__main__.py", "-m")):
        argv[0] = "ignite-mgpu"
    else:
        argv[0] = os.path.basename(argv[0])
    return _printable(" ".join(argv))


class Ticket:
    """A waiting job's place in the queue: ``wait-<start ns>-<pid>-<uid>`` holding what it waits for (GPU names,
    or null for any), flocked while it waits. Jobs start in the order they began waiting: a job lets an earlier,
    still waiting one go first onto the GPUs that one named, and onto every GPU when it takes any (auto)."""

    def __init__(self, dir_fd: int, wants: list[str] | None) -> None:
        self.dir_fd, self.fd = dir_fd, None
        self.name = f"wait-{time.time_ns()}-{os.getpid()}-{os.geteuid()}"
        # Written under a private name, then renamed: no reader ever sees it unlocked (stale) or half written.
        temporary = f"tmp-{self.name}"
        fd = _write_own(dir_fd, temporary, json.dumps({"wants": wants, "command": _command()}).encode())
        if fd is not None:
            try:
                os.rename(temporary, self.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                self.fd = fd
            except OSError:
                os.close(fd)
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Tickets of this user's waits that ended without removing theirs (killed): unlocked, so dead."""
        for entry in _entries(self.dir_fd):
            m = _TICKET.fullmatch(entry)
            if not m or int(m[3]) != os.geteuid() or entry == self.name:
                continue
            opened = _open_file(self.dir_fd, entry)
            if isinstance(opened, tuple):
                try:
                    if opened[1].st_uid == os.geteuid() and _is_locked(opened[0]) is False:
                        os.unlink(entry, dir_fd=self.dir_fd)
                except OSError:
                    pass
                finally:
                    os.close(opened[0])

    def ahead(self) -> list[tuple[Holder, list[str] | None]]:
        """The earlier tickets still waiting: (who, the GPU names it waits for or None for any)."""
        mine = _TICKET.fullmatch(self.name)
        assert mine is not None
        order = (int(mine[1]), int(mine[2]))
        found = []
        for entry in _entries(self.dir_fd):
            m = _TICKET.fullmatch(entry)
            if not m or (int(m[1]), int(m[2])) >= order:
                continue
            opened = _open_file(self.dir_fd, entry)
            if not isinstance(opened, tuple):
                continue
            fd, st = opened
            try:
                data = _read_json(fd) if st.st_uid == int(m[3]) and _is_locked(fd) else None
            finally:
                os.close(fd)
            wants = None if data is None else data.get("wants", False)
            if data is None or not (wants is None or _names(wants)):
                continue  # dead, forged or garbage: only a well-formed, live ticket holds a place
            who = Holder(_user(st.st_uid), int(m[2]), _printable(str(data.get("command", ""))), int(m[1]) / 1e9, True)
            found.append((who, None if wants is None else list(wants)))
        return found

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self.dir_fd)
            os.close(self.fd)
            self.fd = None


def _names(value: object) -> bool:
    return isinstance(value, list) and len(value) <= 64 and all(isinstance(v, str) and len(v) <= 100 for v in value)
