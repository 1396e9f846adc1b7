"""GPU claims on a shared machine: a job holds an ``flock`` on each of its GPUs' lock files in one machine-wide
folder, which the kernel releases when the job dies however it dies; beside it, a file of the holder's own says who
holds it, and waiting jobs queue with a ticket file each. Several users write the folder, so nothing read there is
trusted: no symlink is followed, no other user's file is written, and what cannot be read is "an unknown job".
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
    # Why the claim is not readable, e.g. "a symlink where the lock file should be"
    problem: str = ""
    gpu_range: str = ""  # an elastic job's "MIN-MAX" (--gpus auto:MIN-MAX), else ""

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
                "since": since, "known": self.known, "range": self.gpu_range or None}  # fmt: skip


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
    # Nan, 1e300.
    if not isinstance(since, (int, float)) or isinstance(since, bool) or not 0 < since < 1e11:
        since = None
    text = printable(command) if isinstance(command, str) else ""
    elastic = data.get("range")
    elastic = elastic if isinstance(elastic, str) and re.fullmatch(r"\d{1,4}-\d{1,4}", elastic) else ""
    return Holder(user_name(owner), pid, text, None if since is None else float(since), True, gpu_range=elastic)


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
        self, names: Iterable[str] = (), fds: Iterable[int] = (), by_name: Mapping[str, list[int]] | None = None
    ) -> None:
        self.names = list(names)
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
    about = {"pid": os.getpid(), "command": _command(), "since": time.time()}
    record = json.dumps(about | ({"range": gpu_range} if gpu_range else {})).encode()
    by_name = {name: [fd] for name, fd in zip(wanted, taken, strict=True)}
    # Who holds it, for `ignite-mgpu devices` and the messages of other jobs; best effort.
    for name in wanted:
        if (fd := shared_dir.write_own(dir_fd, f"{name}.{os.geteuid()}.holder", record)) is not None:
            taken.append(fd)
            by_name[name].append(fd)
    return GpuClaims(wanted, taken, by_name)


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


def _command() -> str:
    """This job's command line as its user typed it, shortened."""
    argv = list(sys.argv) or ["python"]
    if argv[0].endswith(("ignite_mgpu/__main__.py", "-m")):
        argv[0] = "ignite-mgpu"
    else:
        argv[0] = os.path.basename(argv[0])
    return printable(" ".join(argv))


class Ticket:
    """A waiting job's place in the queue: ``wait-<start ns>-<pid>-<uid>`` holding what it waits for (GPU names,
    or null for any), flocked while it waits. Jobs start in the order they began waiting: a job lets an earlier,
    still waiting one go first onto the GPUs that one named, and onto every GPU when it takes any (auto)."""

    def __init__(self, dir_fd: int, wants: list[str] | None) -> None:
        self.dir_fd, self.fd = dir_fd, None
        self.name = f"wait-{time.time_ns()}-{os.getpid()}-{os.geteuid()}"
        # Written under a private name, then renamed: no reader ever sees it unlocked (stale) or half written.
        temporary = f"tmp-{self.name}"
        fd = shared_dir.write_own(dir_fd, temporary, json.dumps({"wants": wants, "command": _command()}).encode())
        if fd is not None:
            try:
                os.rename(temporary, self.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                self.fd = fd
            except OSError:
                os.close(fd)
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Tickets of this user's waits that ended without removing theirs (killed): unlocked, so dead."""
        for entry in shared_dir.entries(self.dir_fd, lambda n: _TICKET.fullmatch(n.removeprefix("tmp-"))):
            m = _TICKET.fullmatch(entry.removeprefix("tmp-"))  # tmp-: killed before it was renamed
            if not m or int(m[3]) != os.geteuid() or entry == self.name:
                continue
            opened = shared_dir.open_file(self.dir_fd, entry)
            if isinstance(opened, tuple):
                try:
                    if opened[1].st_uid == os.geteuid() and shared_dir.is_locked(opened[0]) is False:
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
        for entry in shared_dir.entries(self.dir_fd, _TICKET.fullmatch):
            m = _TICKET.fullmatch(entry)
            if not m or (int(m[1]), int(m[2])) >= order:
                continue
            opened = shared_dir.open_file(self.dir_fd, entry)
            if not isinstance(opened, tuple):
                continue
            fd, st = opened
            try:
                data = shared_dir.read_json(fd) if st.st_uid == int(m[3]) and shared_dir.is_locked(fd) else None
            finally:
                os.close(fd)
            wants = None if data is None else data.get("wants", False)
            if data is None or not (wants is None or _names(wants)):
                continue  # dead, forged or garbage: only a well-formed, live ticket holds a place
            who = Holder(
                user_name(st.st_uid), int(m[2]), printable(str(data.get("command", ""))), int(m[1]) / 1e9, True
            )
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
