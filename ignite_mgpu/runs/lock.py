"""One job per run folder: an ``fcntl.flock`` on its lock file while the job writes there, released by the kernel
when the job dies however it dies. Torch-free."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs.folder import LOCK
from ignite_mgpu.runs.writable import os_error_paragraph


def lock_owner(output_dir: Path) -> str | None:
    """Who holds the lock of ``output_dir`` ("pid N on host H"), or None when no running job holds it.

    The lock is an ``fcntl.flock`` on the file, so the kernel (and the NFS lock manager) drops it when its job
    dies, however it dies: a lock file left behind by a killed job locks nothing.
    """
    import fcntl

    try:
        fd = os.open(output_dir / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another job"
    except OSError:
        return None  # no flock on this file system; output_lock warns about it
    finally:
        os.close(fd)  # also releases the probe's shared lock
    return None


def locked_message(output_dir: Path, owner: str) -> str:
    return (
        f"output_dir {output_dir} is locked by {owner}, another job writing there; wait for it or choose "
        "another --output-dir."
    )


def _take_lock(lock: Path, output_dir: Path) -> int | None:
    """An fd holding an exclusive ``flock`` on ``lock``; ConfigError when another job holds it; None (with a
    warning) on a file system without ``flock``."""
    import fcntl

    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise ConfigError(os_error_paragraph(output_dir, err)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another job"
            os.close(fd)
            raise ConfigError(locked_message(output_dir, owner)) from None
        except OSError as err:  # e.g. Lustre mounted noflock, NFS without a lock manager
            os.close(fd)
            print(
                f"ignite-mgpu: warning: cannot lock {lock} ({err.strerror}): a second job started on the same "
                "output_dir would not be refused.",
                file=sys.stderr,
            )
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                return fd
        except FileNotFoundError:
            pass
        # Locked a file that a finishing job has just removed: lock the one at the path now.
        os.close(fd)


@contextlib.contextmanager
def output_lock(output_dir: Path) -> Iterator[None]:
    """One job per output folder: a second one fails fast instead of mixing checkpoints."""
    lock = output_dir / LOCK
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd = _take_lock(lock, output_dir)
    except OSError as err:
        raise ConfigError(os_error_paragraph(output_dir, err)) from None
    if fd is None:
        yield
        return
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode())
        except OSError as err:  # a disk already full
            raise ConfigError(os_error_paragraph(output_dir, err)) from None
        yield
    finally:
        # Before the unlock: a waiting job then re-checks and locks a new file.
        lock.unlink(missing_ok=True)
        os.close(fd)
