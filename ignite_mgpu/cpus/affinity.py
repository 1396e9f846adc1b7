"""In a worker: its CPU binding applied before torch starts its thread pools (the affinity of every thread, the
intra-op threads, numpy's BLAS threads), the process group's own threads moved to the CPUs planned for them, and
the CPU share that ``data.num_workers=auto`` reads. The plan is ``binding.py``'s. Torch-free at import.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

from ignite_mgpu.cpus.binding import THREAD_VARS, RankBinding

# This process's binding, set by the process layer, read by data.py.
_current: RankBinding | None = None


def current() -> RankBinding | None:
    """The binding applied to this process (None when ignite-mgpu's launcher did not start it)."""
    return _current


def cpu_share(local_processes: int) -> int:
    """The CPUs this process counts as its own: its planned share, else its affinity split over the local ranks."""
    if _current is not None:
        return _current.share
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_processes))


def _set_affinity(cpus: set[int]) -> list[tuple[int, set[int]]]:
    """Bind every thread of this process that still has the process's mask; returns (thread, old mask) pairs."""
    before = os.sched_getaffinity(0)
    changed = [(0, before)]
    # Pid 0: the calling thread; threads it starts from now on inherit the mask.
    os.sched_setaffinity(0, cpus)
    # Threads started earlier (an import) keep theirs otherwise.
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        with contextlib.suppress(OSError):  # the thread may have ended meanwhile
            mask = os.sched_getaffinity(tid)
            if mask == before:
                os.sched_setaffinity(tid, cpus)
                changed.append((tid, mask))
    return changed


def thread_ids() -> set[int]:
    """The ids of this process's threads now."""
    return {int(name) for name in os.listdir("/proc/self/task")}


def free_group_threads(started_before: set[int]) -> None:
    """Give the threads started since ``started_before`` (``thread_ids()`` before joining the process group: the
    group's threads) the CPUs the binding planned for them.

    Bound beside the training thread on a one-CPU share, gloo's communication threads take turns with the backward
    instead of overlapping it, and the step gets slower than unbound (``benchmarks/`` measures it).
    """
    if _current is None or _current.cpus is None or _current.group_cpus is None:
        return
    bound, group = set(_current.cpus), set(_current.group_cpus)
    for tid in thread_ids() - started_before:
        with contextlib.suppress(OSError):  # the thread may have ended meanwhile
            # Inherited from the training thread, not set by its owner.
            if os.sched_getaffinity(tid) == bound:
                os.sched_setaffinity(tid, group)


def apply_binding(rank: RankBinding) -> Callable[[], None]:
    """Bind this process as ``rank`` says; call it before torch starts its thread pools. Returns the undo (for a
    job run inside the caller's process); a spawned worker just exits."""
    global _current
    previous, saved_env = _current, {var: os.environ.get(var) for var in THREAD_VARS}
    torch = sys.modules.get("torch")
    saved_threads = torch.get_num_threads() if torch is not None else None
    _current = rank
    if rank.threads is not None:
        os.environ.update({var: str(rank.threads) for var in THREAD_VARS})  # read when torch starts
        # Already imported (by the job function's module): its pool exists, resize it.
        if torch is not None:
            torch.set_num_threads(rank.threads)
    changed = _set_affinity(set(rank.cpus)) if rank.cpus is not None else []

    def undo() -> None:
        global _current
        _current = previous
        for tid, mask in changed:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, mask)
        if rank.threads is not None:
            for var, value in saved_env.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            now = sys.modules.get("torch")
            if now is not None and saved_threads is not None:
                now.set_num_threads(saved_threads)

    return undo


# A BLAS library's own thread-count variable, which it reads before OMP_NUM_THREADS.
BLAS_THREAD_VARS = {"openblas": "OPENBLAS_NUM_THREADS", "mkl": "MKL_NUM_THREADS", "blis": "BLIS_NUM_THREADS"}


def blas_threads_as_torch(threads: int | None) -> None:
    """numpy's BLAS (OpenBLAS, MKL, BLIS) read their thread count from the environment once, when numpy loads: in
    the fork server, or in this worker while the job function's module was imported, before the binding. Without
    this, every worker's (and every loader worker's) matrix products would start a thread per core of the machine.
    Set each as a process that loaded numpy now would: its own variable (OPENBLAS_NUM_THREADS, ...) when set, else
    torch's count (the binding's, else OMP_NUM_THREADS). numpy not loaded yet: it will read the environment."""
    if "numpy" not in sys.modules:
        return
    omp = os.environ.get("OMP_NUM_THREADS", "")
    count = threads if threads is not None else int(omp) if omp.isdigit() else None
    if count is None:
        return
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    for api, var in BLAS_THREAD_VARS.items():
        own = os.environ.get(var, "")
        controller.select(internal_api=api).limit(limits=max(1, int(own) if own.isdigit() else count))
