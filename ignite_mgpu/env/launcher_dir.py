"""The launcher's private folder, ``<tmp>/ignite-mgpu-<pid>-<random>``: the supervisor makes it private (0700) and
holds it open, with an flock, for the job's life; its workers' attempt folders, rendezvous files and stacks files
live in it. Anyone can create a folder of that name in a shared temporary folder, so ``ignite-mgpu stacks PID``
trusts one only when it is this user's, private, and held open by process PID (``why_untrusted``); the folders that
killed launchers left behind (SIGKILL runs no clean-up) are removed by this user's next launcher (``remove_dead``).
Torch-free."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from ignite_mgpu.text import user_name

PREFIX = "ignite-mgpu-"
_NAME = re.compile(rf"{PREFIX}(\d+)-[A-Za-z0-9_]+")
_MAX_FDS = 4096  # a launcher holds few files: a process with more is not looked at further
# A folder this young is never removed: its launcher may not hold its flock yet.
_YOUNG = 60.0


def make() -> tuple[Path, int]:
    """A new private folder named by this process, and an fd holding it open (close it with ``remove``)."""
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")  # 0700
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    # Released by the kernel however this process ends; a launcher whose pid this namespace cannot see (another
    # container sharing the temporary folder) holds it too.
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return Path(folder), fd


def remove(folder: Path, fd: int) -> None:
    """The folder and what is in it removed, the fd closed."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.close(fd)


def _owner(pid: int) -> int | None:
    """The real uid of process ``pid``; None when it is gone (or hidden)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError):
        return None


def held_by(pid: int, folder: Path) -> bool:
    """Whether process ``pid`` holds ``folder`` open (one of its fds is that folder: the same device and inode)."""
    try:
        want = os.lstat(folder)
        fds = os.listdir(f"/proc/{pid}/fd")[:_MAX_FDS]
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            st = os.stat(f"/proc/{pid}/fd/{fd}")  # follows the link to what the fd holds
            if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                return True
    return False


def why_untrusted(folder: Path, pid: int) -> str | None:
    """None when ``folder`` is the live private folder of launcher ``pid``: a real folder (no symlink), this user's,
    private (0700), held open by ``pid``; else why not, to follow the folder's path in a message."""
    try:
        st = os.lstat(folder)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder (a symlink or a file in its place)"
    if st.st_uid != os.geteuid():
        return f"belongs to {user_name(st.st_uid)}, not to {user_name(os.geteuid())}: another user made it"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"is not private (mode {stat.S_IMODE(st.st_mode):04o}; a launcher makes its folder 0700)"
    if not held_by(pid, folder):
        return f"is not held open by process {pid}, so no live launcher of ignite-mgpu made it"
    return None


def remove_dead(tmp: str | None = None) -> list[Path]:
    """Remove this user's private folders of launchers that are gone (killed before they could remove them): only
    real folders, this user's, private, older than a minute, whose pid runs no process of this user and whose flock
    nobody holds. Returns those removed."""
    removed = []
    base = Path(tmp or tempfile.gettempdir())
    with contextlib.suppress(OSError), os.scandir(base) as entries:
        for entry in entries:
            match = _NAME.fullmatch(entry.name)
            if match is None or int(match[1]) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o077
                # A live process of this user may be its launcher, even before it holds the folder's flock.
                if mine and time.time() - st.st_mtime > _YOUNG and _owner(int(match[1])) != os.geteuid():
                    if _remove_unlocked(Path(entry.path)):
                        removed.append(Path(entry.path))
    return removed


def _remove_unlocked(folder: Path) -> bool:
    """Remove ``folder`` unless a live launcher holds its flock (one of another PID namespace too)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        shutil.rmtree(folder)
    finally:
        os.close(fd)
    return True
