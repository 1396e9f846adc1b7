"""The fork server: one process per job that imports torch, ignite and the default job's code once and then forks
every worker of every attempt (multiprocessing's "forkserver"), so that a restart forks instead of importing again.

It never touches CUDA or a process group (importing torch does neither). A worker it forks inherits the server's
environment of when it started, so the supervisor passes its own and the worker applies it first (worker.py).
Torch-free: the server imports the preloaded modules, this process does not.

multiprocessing has no public handle on its fork server: ``forkserver._forkserver`` and its ``_forkserver_pid``,
``_forkserver_alive_fd``, ``_forkserver_address`` and ``_lock`` are private, guarded by ``tests/test_private_apis.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing import forkserver, resource_tracker
from multiprocessing import util as mp_util
from typing import Any

from ignite_mgpu.processes.job import Job

METHOD = "forkserver"
# In the server's own environment only: "launcher pid:signals it ignores"
_IGNORES = "IGNITE_MGPU_SERVER"
# What every worker of the process layer imports: ignite.distributed (worker.run_in_group) and torch; torch._dynamo
# is the largest part, imported when the first optimizer is built (torch.optim's add_param_group).
PRELOAD = ("torch", "torch._dynamo", "ignite.distributed", "ignite_mgpu.processes.worker")
# The default job. Not OmegaConf (a quarter of a second): rank 0 writes config.yaml with PyYAML.
DEFAULT_JOB = ("ignite_mgpu.train.default_job",)
_OWN = "ignite_mgpu."
_started: list[int] = []  # the pid of the server that this process started (and stops), if one runs
_ended: list[str] = []  # how that server ended, once seen ("was killed by SIGKILL")
_kept: list[bool] = []  # inside kept_between_jobs(): each job's stop leaves the server up


def preload_for(job: Job) -> list[str]:
    """The modules the server imports: torch, ignite, and the job's module when it is ignite-mgpu's own (the default
    job's, named or not). A user's module is imported by each worker after the fork, as a spawned worker imports it:
    what it runs at import (a CUDA query, reading the environment) runs where it would there."""
    # This module first: the server ignores the stop signals while it imports.
    modules = [__name__, *PRELOAD]
    if job.module == DEFAULT_JOB[0]:
        modules += DEFAULT_JOB
    elif job.module.startswith(_OWN) and job.module not in modules:
        modules.append(job.module)
    return modules


def start(preload: list[str], preempt_signal: int | None = None) -> int:
    """Start the fork server with ``preload`` imported (or find the one already running); returns its pid.

    The server ignores SIGINT, SIGTERM and ``preempt_signal``: sent to every process of a job (a terminal's
    process group, a SLURM step), they are the supervisor's to handle, and the server's death would kill every
    worker (their death signal) before they could stop and checkpoint; a Ctrl-C while it imports would print its
    traceback. (multiprocessing ignores SIGINT in the server itself, but only once the imports are done; a worker
    ignores it too, as its own process group.) It imports with this process's ``sys.path`` (Python before
    3.12 ignores the one multiprocessing passes it): else an installed copy could shadow a checkout.
    """
    server: Any = forkserver._forkserver  # the module's one server (private API)
    if _started:
        # Ours died (the OOM killer, a kill by hand), or multiprocessing already replaced it, as a worker started,
        # by a plain server that neither ignores the stop signals nor dies with this process: ours again, below.
        if server._forkserver_pid != _started[0]:
            _end(server)
        elif _reaped(server._forkserver_pid):
            _end(server, reaped=True)
    ours = server._forkserver_pid is None
    if ours:
        mp.get_context(METHOD).set_forkserver_preload(preload)
        ignores = [int(signal.SIGINT), int(signal.SIGTERM), *([preempt_signal] if preempt_signal else [])]
        paths = os.pathsep.join(p or os.getcwd() for p in sys.path if isinstance(p, str))
        told = f"{os.getpid()}:{','.join(map(str, ignores))}"
        # The server inherits a mask that blocks them until it ignores them (the module's end, its first import),
        # as multiprocessing's resource tracker is started (started first here: it unblocks them after its own
        # start); in this process they wait for the unblock, none is lost.
        resource_tracker.ensure_running()
        _socket_folder_that_binds()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ignores)
        try:
            with _environment_for_the_server({"PYTHONPATH": paths, _IGNORES: told}):
                forkserver.ensure_running()
            # Before the unblock, whose pending Ctrl-C raises here.
            _started[:] = [int(server._forkserver_pid)]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    else:
        # Ours, alive; or another part's, which multiprocessing restarts if it died.
        forkserver.ensure_running()
    return int(server._forkserver_pid)


def _socket_folder_that_binds() -> None:
    """multiprocessing's folder for the server's socket (``pymp-*``), made in /tmp where TMPDIR is too long for it.

    A Unix socket's path holds at most 107 bytes; multiprocessing makes its folder in TMPDIR and its socket in that
    (``TMPDIR/pymp-<8 characters>/listener-<8 more>``), so a TMPDIR past about 70 bytes (a SLURM job's scratch
    folder, a per-user folder on macOS, a test's temporary folder) made the job fail with ``OSError: AF_UNIX path
    too long``. The folder is made once per process and kept for it; removed with it."""
    socket = os.path.join(tempfile.gettempdir(), "pymp-12345678", "listener-12345678")
    if len(os.fsencode(socket)) < 100 or not os.access("/tmp", os.W_OK):
        return
    previous, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        mp_util.get_temp_dir()  # made now, in /tmp, and kept by multiprocessing for this process
    finally:
        tempfile.tempdir = previous


def how_it_ended(wait: float = 0.0) -> str | None:
    """How the server that ``start`` started here ended ("was killed by SIGKILL", "exited with code 1"); None while
    it runs (after up to ``wait`` seconds), or when none was started here. Its workers die with it (their death
    signal, sent while it exits), and multiprocessing then knows none of their exit codes: it says 255 for each."""
    if not _started:
        return None
    deadline = time.monotonic() + wait
    while not _ended:
        try:
            pid, status = os.waitpid(_started[0], os.WNOHANG)
        except ChildProcessError:  # waited for elsewhere
            pid, status = _started[0], -1
        if pid == 0:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
            continue
        if status >= 0 and os.WIFSIGNALED(status):
            _ended.append(f"was killed by {signal.Signals(os.WTERMSIG(status)).name}")
        else:
            _ended.append(f"exited with code {os.WEXITSTATUS(status)}" if status >= 0 else "ended")
    return _ended[0]


def _reaped(pid: int) -> bool:
    """Whether the server ``pid`` has ended (then waited for here)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


def _end(server: Any, reaped: bool = False) -> None:
    """Forget the server multiprocessing runs (as its ``ensure_running`` does with a dead one), SIGKILLed and waited
    for first unless it was ``reaped`` already; its socket file is removed."""
    with server._lock:
        pid, server._forkserver_pid = server._forkserver_pid, None
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = None
        if pid is not None and not reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        address, server._forkserver_address = server._forkserver_address, None
        if isinstance(address, str) and not address.startswith("\0"):
            with contextlib.suppress(OSError):
                os.unlink(address)
    _started.clear()
    _ended.clear()


@contextlib.contextmanager
def _environment_for_the_server(changes: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``changes`` while the server starts (it copies the environment)."""
    saved = {var: os.environ.get(var) for var in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                del os.environ[var]
            else:
                os.environ[var] = value


@contextlib.contextmanager
def kept_between_jobs() -> Iterator[None]:
    """The server that ``start`` starts inside stays up from one job to the next (``ignite-mgpu scale``'s sizes, where
    each job's supervisor would stop it at the job's end: a new one imports torch again), and is stopped on leaving."""
    _kept.append(True)
    try:
        yield
    finally:
        _kept.pop()
        stop()


def stop() -> None:
    """Stop the server that ``start`` started here, at once: SIGKILL (it holds nothing to save, and a Python exit
    with torch loaded takes seconds), which also ends, through their death signal, any worker it forked that
    still runs. Inside ``kept_between_jobs``: nothing, until it is left."""
    server: Any = forkserver._forkserver  # the module's one server (private API)
    if _started and not _kept:  # (else none, or another part of the program's)
        _end(server)  # ours, or the plain one multiprocessing replaced it with


def die_with(parent: int | None) -> None:
    """Arm this process's death signal: SIGKILL when its parent dies (even by SIGKILL), so that a dead launcher
    leaves no worker holding GPUs and ports. A parent that died before the signal was armed has already handed
    this process to another one (``parent``: its pid, None: not checked): then exit at once."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def leave_server() -> None:
    """In a worker the server forked: close its copy of the server's alive pipe. The server exits when every holder
    of that pipe is gone; with the launcher dead (even by SIGKILL) only the workers would still hold it, and they
    would keep the server, and so themselves, alive (their death signal comes from the server)."""
    server: Any = forkserver._forkserver  # the module's one server (private API)
    fd = server._forkserver_alive_fd
    if fd is not None:
        server._forkserver_alive_fd = server._forkserver_pid = None
        with contextlib.suppress(OSError):
            os.close(fd)


def from_the_server(environ: dict[str, str], threads: int | None) -> None:
    """A worker forked by the fork server: the supervisor's environment replaces the server's (of when it started),
    and what torch read at its import in the server follows it: the intra-op threads (libgomp reads
    OMP_NUM_THREADS once, when it loads). ``threads``: the binding's own count, already applied."""
    # The server's objects (torch's, ignite's modules) leave the garbage collector's view: its first full pass over
    # them here would write to every one, copying the pages shared with the server (0.7 s of a restart, measured).
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    torch = sys.modules.get("torch")
    if torch is not None and threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


def check_served_fork() -> None:
    """The server must never start CUDA (nor ask it anything): every worker it forks would then fail to use it."""
    torch = sys.modules.get("torch")
    # is_initialized() is false in a bad fork; only the private flag tells it (tests/test_private_apis.py)
    if torch is not None and (torch.cuda.is_initialized() or torch.cuda._is_in_bad_fork()):
        raise RuntimeError("the fork server touched CUDA before forking this worker (a bug of ignite-mgpu)")


def _in_the_server() -> bool:
    """Whether this process is the fork server, importing its preloaded modules (``forkserver.main`` runs)."""
    import inspect  # here: only the server asks (torch imports it there anyway)

    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def quiet_refused_fork(server: int) -> Callable[..., None]:
    """The server's excepthook: a fork the machine refused (EAGAIN: the per-user process limit; ENOMEM) ends the
    server without its traceback, as the launcher says it in one paragraph (``outcome.refused_start``); anything
    else, and anything in a forked worker, is printed as usual."""

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        refused = isinstance(value, OSError) and value.errno in (errno.EAGAIN, errno.ENOMEM)
        if not (refused and os.getpid() == server):
            sys.__excepthook__(kind, value, tb)

    return hook


if _IGNORES in os.environ and _in_the_server():  # preloaded first, in the server only
    # The server dies with the launcher at once (then every worker, by their own death signal); a Python exit on
    # the end of its alive pipe would first take seconds to unload torch.
    _launcher, _numbers = os.environ.pop(_IGNORES).split(":")
    die_with(int(_launcher))
    sys.excepthook = quiet_refused_fork(os.getpid())
    _ignored = [int(n) for n in _numbers.split(",")]
    for _number in _ignored:
        signal.signal(_number, signal.SIG_IGN)  # a forked worker sets its own handlers for these
    # Blocked since the server started (``start``)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _ignored)
