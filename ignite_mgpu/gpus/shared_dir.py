"""Files in a folder that several users write (the GPU claims folder): opened relative to the folder's fd, never
through a symlink, never blocking (a FIFO), read at most 4 KiB, written only when this user owns them. Nothing read
here is trusted: a caller gets an fd and its fstat, or why the file cannot be used. Torch-free."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Callable

MAX_READ = 4096  # bytes read of any file in the folder: a huge file costs no more than a small one
MAX_ENTRIES = 10_000  # entries of one kind (holder files, tickets) looked at when searching
# O_NONBLOCK: a FIFO never blocks open.
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class UnsafeFolder(Exception):
    """The folder cannot be trusted or used; the message says why."""


# Why a file cannot be made or written in the folder, by errno: never "another job was faster".
_CANNOT_WRITE = {
    errno.EROFS: "it is on a read-only file system",
    errno.EACCES: "this user may not write in it",
    errno.EPERM: "this user may not write in it",
    errno.ENOSPC: "its disk is full",
    errno.EDQUOT: "this user's disk quota is used up",
}


def write_problem(err: OSError) -> str:
    """Why a file cannot be made or written in the folder, with the error's text and errno name: "it is on a
    read-only file system (Read-only file system, EROFS)"."""
    name = errno.errorcode.get(err.errno or 0, f"errno {err.errno}")
    what = _CANNOT_WRITE.get(err.errno or 0, "a file cannot be made or written in it")
    return f"{what} ({err.strerror or err}, {name})"


def printable(text: str, limit: int = 200) -> str:
    """Untrusted text made safe for a terminal: no control characters (escape sequences), at most ``limit``."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def open_dir(path: str, create: bool) -> int | None:
    """An fd of the folder (every later open is relative to it, so a swapped path cannot redirect them); made
    sticky and writable by all (like /tmp) when ``create`` and missing. None when missing and not ``create``.

    Raises:
        UnsafeFolder: not a real folder, or writable by others without the sticky bit (anyone could delete a file).
    """
    if create:
        try:
            os.mkdir(path, 0o1777)
            with contextlib.suppress(OSError):  # the umask took bits off
                os.chmod(path, 0o1777, follow_symlinks=False)
        except FileExistsError:
            pass
        except OSError as err:
            raise UnsafeFolder(f"it does not exist and cannot be made: {write_problem(err)}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            return None
        raise UnsafeFolder("it does not exist and cannot be made") from None
    except OSError as err:
        why = "it is a symlink, which is never followed" if os.path.islink(path) else (err.strerror or str(err))
        raise UnsafeFolder(why) from None
    mode = os.fstat(fd).st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        os.close(fd)
        raise UnsafeFolder("it is writable by other users but not sticky, so any of them could delete a claim")
    return fd


def open_file(dir_fd: int, name: str, writable: bool = False) -> tuple[int, os.stat_result] | str | None:
    """(fd, fstat) of the regular file ``name``; None when it does not exist; else why it cannot be used."""
    try:
        fd = os.open(name, (os.O_RDWR if writable else os.O_RDONLY) | OPEN_FLAGS, dir_fd=dir_fd)
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


def create_file(dir_fd: int, name: str, writable: bool) -> int | None:
    """A new file ``name`` readable by every user (so anyone can flock it), or None when the name is taken.

    Raises:
        OSError: the folder takes no new file (read-only, not writable by this user, full): ``write_problem``.
    """
    try:
        mode = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CREAT | os.O_EXCL | OPEN_FLAGS
        fd = os.open(name, mode, 0o644, dir_fd=dir_fd)
    except FileExistsError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:  # a symlink made at that name a moment ago: taken
            return None
        raise
    os.fchmod(fd, 0o644)  # whatever the umask
    return fd


def is_locked(fd: int) -> bool | None:
    """Whether another open file holds an flock on it; None when this file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def read_json(fd: int) -> dict | None:
    """The JSON object in the file's first MAX_READ bytes, or None for anything else."""
    try:
        value = json.loads(os.pread(fd, MAX_READ, 0).decode("utf-8"))
    except Exception:  # garbage, truncated, too deeply nested: unknown, never a crash
        return None
    return value if isinstance(value, dict) else None


def read_live(dir_fd: int, name: str, uid: int) -> dict | None:
    """The JSON object of a live file ``name`` written by ``uid``: a regular file owned by that user and held by an
    flock (its writer is alive); None for anything else (dead, forged, garbled, gone)."""
    opened = open_file(dir_fd, name)
    if not isinstance(opened, tuple):
        return None
    fd, st = opened
    try:
        return read_json(fd) if st.st_uid == uid and is_locked(fd) else None
    finally:
        os.close(fd)


def entries(dir_fd: int, keep: Callable[[str], object]) -> list[str]:
    """The names in the folder that ``keep`` accepts, sorted, at most MAX_ENTRIES: filtered before the cap, so that
    any number of other files never hides one that matters."""
    try:
        with os.scandir(dir_fd) as found:
            return sorted(entry.name for entry in found if keep(entry.name))[:MAX_ENTRIES]
    except OSError:
        return []


def write_own(dir_fd: int, name: str, data: bytes) -> int | None:
    """Write ``data`` into this user's file ``name`` and hold an flock on it; None (nothing written) when the
    name is taken by something that is not this user's regular file, or by a holder of its lock.

    Raises:
        OSError: the folder takes no new file, or the file no data (``write_problem``).
    """
    opened = open_file(dir_fd, name, writable=True)
    if opened is None:
        fd = create_file(dir_fd, name, writable=True)
        if fd is None:
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
    except OSError as err:
        os.close(fd)
        if err.errno in _CANNOT_WRITE:
            raise
        return None
    return fd
