"""Whether a run folder can be made and written, said as one paragraph: the folder named, what is wrong (a file in
its place or above it, a read-only file system, an immutable folder, no permission, a full disk) and the fix. Also
how a full disk during training is said (the folder and its free space). Torch-free, a leaf."""

from __future__ import annotations

import array
import errno
import fcntl
import os
from pathlib import Path

from ignite_mgpu.runs.regular import why_not_regular

FS_IOC_GETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x10  # linux/fs.h: chattr's flags, +i
FIX = "choose another --output-dir"


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (as anything: a file above the folder is found too)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _immutable(folder: Path) -> bool:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        flags = array.array("l", [0])  # the kernel writes an int; a long leaves room
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        return bool(flags[0] & FS_IMMUTABLE_FL)
    except OSError:  # a file system without chattr's flags
        return False
    finally:
        os.close(fd)


def _why_unwritable(folder: Path) -> str | None:
    """What keeps a new file out of the existing ``folder``, or None."""
    try:
        st = os.statvfs(folder)
    except OSError as err:
        return f"{folder} cannot be read ({err.strerror})"
    if st.f_flag & os.ST_RDONLY:
        return f"{folder} is on a read-only file system"
    if _immutable(folder):
        return f"{folder} is immutable (chattr +i; lsattr -d shows the i)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable by this user"
    # A file system that counts no blocks or inodes (btrfs has no inode count) says 0 free of them: not full.
    no_blocks, no_inodes = st.f_blocks > 0 and st.f_bavail == 0, st.f_files > 0 and st.f_favail == 0
    if no_blocks or no_inodes:
        return f"the disk of {folder} is full ({'no free blocks' if no_blocks else 'no free inodes'})"
    return None


def folder_problem(output_dir: str | os.PathLike) -> str | None:
    """Why ``output_dir`` cannot be made or written, as one paragraph (None: it can), checked without writing."""
    out = Path(output_dir)
    found = _nearest_existing(out)
    itself = found == Path(os.path.abspath(out))
    if not found.is_dir():
        what = (why_not_regular(found) or "is a regular file").removesuffix(", not a regular file")
        if itself:
            return f"output_dir {out} {what}, not a folder: remove it or {FIX}."
        return f"output_dir {out} cannot be made: {found} {what}, not a folder. Remove it or {FIX}."
    why = _why_unwritable(found)
    if why is None:
        return None
    return f"output_dir {out} {'cannot be written' if itself else 'cannot be made'}: {why}. Fix that or {FIX}."


def os_error_paragraph(output_dir: str | os.PathLike, err: OSError) -> str:
    """An OSError met while making or locking ``output_dir``, as ``folder_problem`` says it (or by its errno)."""
    known = folder_problem(output_dir)
    if known is not None:
        return known
    if err.errno == errno.ENOSPC:
        return f"output_dir {output_dir} cannot be written: no space left on its disk. Free some space or {FIX}."
    return f"output_dir {output_dir} cannot be made or written ({err.strerror or err}); {FIX}."


def no_space_message(folder: str | os.PathLike) -> str:
    """A full disk while a run writes: the folder and its free space."""
    try:
        st = os.statvfs(folder)
        free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free"
    except OSError:
        free = "its free space unknown"
    return f"No space left on device: {folder} has {free}"
