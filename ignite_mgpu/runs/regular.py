"""The one way to open a path that the user or a run folder names (a checkpoint, a config file): a regular file only
(a symlink is followed only to a regular file), checked before it is opened and opened without blocking, read
within a bound. A FIFO, a device, a socket or a folder is a reason, never a hang or a read without end. Torch-free,
a leaf."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

# O_NONBLOCK: a FIFO swapped in after the check still never blocks open; O_NOCTTY: a terminal never becomes ours.
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegular(OSError):
    """The path is not a regular file that can be read; the message says what it is instead."""


def kind(mode: int) -> str:
    """What a file of this mode is, in words ("a FIFO (named pipe)"); "a regular file" for one."""
    return next((name for test, name in KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else "a file")


def why_not_regular(path: str | os.PathLike) -> str | None:
    """None for a regular file (or a symlink to one); else what the path is instead ("does not exist", "is a FIFO
    (named pipe)", "is a symlink to a character device"), without opening it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode  # follows symlinks: one to a regular file is fine
    except FileNotFoundError:
        return "is a broken symlink" if path.is_symlink() else "does not exist (no such file)"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if stat.S_ISREG(mode):
        return None
    return f"is {'a symlink to ' if path.is_symlink() else ''}{kind(mode)}, not a regular file"


def open_regular(path: str | os.PathLike) -> int:
    """A file descriptor of ``path``, checked to be a regular file once open (what is read is what was checked).

    Raises:
        NotRegular: not a regular file, or it cannot be opened (the message says which).
    """
    why = why_not_regular(path)
    if why is not None:
        raise NotRegular(f"{path} {why}")
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as err:
        raise NotRegular(f"{path} cannot be opened ({err.strerror or err})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped between the check and the open
        os.close(fd)
        raise NotRegular(f"{path} is {kind(mode)}, not a regular file")
    return fd


@contextlib.contextmanager
def opened_regular(path: str | os.PathLike) -> Iterator[str]:
    """A name of the regular file ``path`` that cannot be swapped for another file while it is used: the open,
    checked descriptor's ``/proc/self/fd/N`` (where the system has it), for readers that take a name (torch.load's
    zip reader, safetensors' memory map, zipfile). Raises ``NotRegular`` as ``open_regular`` does."""
    fd = open_regular(path)
    try:
        by_fd = f"/proc/self/fd/{fd}"
        yield by_fd if os.path.exists(by_fd) else os.fspath(path)
    finally:
        os.close(fd)


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Raises:
        NotRegular: not a regular file, or larger than ``limit`` (the message says which).
    """
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise NotRegular(f"{path} is {st.st_size} bytes, more than the {limit} a file of its kind may have")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:  # grew while read
        raise NotRegular(f"{path} is more than the {limit} bytes a file of its kind may have")
    return data
