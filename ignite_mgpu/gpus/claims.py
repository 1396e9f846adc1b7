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

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import shared_dir
from ignite_mgpu.gpus.shared_dir import printable

CLAIMS_DIR_ENV = "IGNITE_MGPU_CLAIMS_DIR"  # for servers whose users do not share /tmp
DEFAULT_CLAIMS_DIR = "/tmp/ignite-mgpu-claims"
# A reader's probe holds a shared lock for a moment: a claim retries before it gives up.
_LOCK_TRIES = 5


def claims_dir(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(CLAIMS_DIR_ENV) or DEFAULT_CLAIMS_DIR


def claim_name(uuid: str, bus_id: str) -> str:
    """The GPU's name in the folder: its UUID (GPU-8a0e...), else its PCI bus id; only [A-Za-z0-9.-]."""
    name = uuid or f"pci-{bus_id}"
    return re.sub(r"[^A-Za-z0-9.-]", "_", name)[:100]


def open_dir(path: str, create: bool) -> int | None:
    """An fd of the claims folder (``shared_dir.open_dir``); None when it does not exist and ``create`` is False.

    Raises:
        ConfigError: not a real folder, or writable by others without the sticky bit (anyone could delete a claim).
    """
    try:
        return shared_dir.open_dir(path, create)
    except shared_dir.UnsafeFolder as err:
        raise _unusable(path, str(err)) from None


def unwritable(err: OSError) -> ConfigError:
    """The claims folder takes no new file (read-only, not this user's to write, full): said as such, with its errno;
    never "another job claimed first", which would retry or wait forever."""
    return _unusable(claims_dir(), shared_dir.write_problem(err))


def _unusable(path: str, why: str) -> ConfigError:
    return ConfigError(
        f"the GPU claims folder {path} cannot be used: {why}. Every job on GPUs claims its GPUs there, so that two "
        f"jobs never share one by accident. Set {CLAIMS_DIR_ENV} to a folder every user of this machine can write, "
        "made like /tmp (mkdir -m 1777 DIR), or pass --share to run without claims."
    )


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
        ConfigError: the claims folder's file system has no flock, or the folder takes no new file (read-only, not
            this user's to write, full).
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
    # Who holds it, for `ignite-mgpu devices` and the messages of other jobs (None: the name is another's).
    try:
        for name in wanted:
            if (fd := shared_dir.write_own(dir_fd, f"{name}.{os.geteuid()}.holder", record)) is not None:
                taken.append(fd)
                by_name[name].append(fd)
    except OSError as err:
        for held in taken:
            os.close(held)
        raise unwritable(err) from None
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
            try:
                fd = shared_dir.create_file(dir_fd, name, writable=False)
            except OSError as err:
                raise unwritable(err) from None
            if fd is None:
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
