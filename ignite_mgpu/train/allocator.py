"""CPU training without a page fault per tensor: ``keep_freed_memory`` makes glibc's malloc keep what PyTorch frees.

glibc serves every block above its mmap threshold (128 KiB at first, at most 32 MiB) with a fresh ``mmap`` and gives
it back on ``free``, and trims the top of its heap back to the kernel too. A CPU training step allocates and frees
the same activations and gradients every time, so each step page-faults them in again, and the kernel zero-fills
every page (``benchmarks/allocator/bench_cpu_allocator.py`` measures what it costs). tcmalloc and jemalloc keep such
memory; so does PyTorch's CUDA caching allocator on the GPU.

``frozen_heap`` keeps Python's garbage collector off what exists before training starts (torch's and ignite's modules,
the model, the data): each full pass over them took about 0.1 s, once every few dozen steps of a small model in a
process of its own (one process, or each rank under torchrun); a worker forked from the fork server starts frozen.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import platform
from collections.abc import Iterator

logger = logging.getLogger("ignite_mgpu")

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's <malloc.h>
# Set by the user for glibc, or another allocator preloaded: then the process's malloc is theirs to configure.
MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def keep_freed_memory() -> str | None:
    """Make glibc's malloc keep the memory this process frees, for the next training step to reuse.

    Sets ``mallopt(M_MMAP_MAX, 0)`` (large blocks come from the heap, not from a fresh ``mmap`` each time) and
    ``mallopt(M_TRIM_THRESHOLD, -1)`` (the heap is never trimmed back to the kernel). Call it once, early, in each
    CPU training process; ``ignite-mgpu train`` does so on the CPU unless ``train.keep_cpu_memory=false``. The process
    keeps its peak memory until it exits (so do DataLoader workers forked after the call), and the peak can grow a
    little: aligned blocks fragment the heap (``benchmarks/`` measures how much). It is process-wide and cannot be
    undone.

    Returns None when applied, else why not: not Linux with glibc, a ``MALLOC_*`` variable or a glibc malloc
    tunable already set, or jemalloc/tcmalloc/mimalloc in ``LD_PRELOAD``; in those cases nothing is changed. If
    glibc refuses the second setting, the first stays in force.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not Linux with glibc"
    preloaded = os.environ.get("LD_PRELOAD", "")
    if any(name in preloaded for name in OTHER_ALLOCATORS):
        return f"another allocator is preloaded (LD_PRELOAD={preloaded})"
    chosen = [name for name in MALLOC_ENV if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"{', '.join(chosen)} already set"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError) as e:
        return f"mallopt not found ({e})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, -1) != 1:
        return "mallopt refused the settings"
    return None


def setup_cpu_memory(keep: bool, device_type: str, sharded: bool = False) -> None:
    """For a process training on ``device_type``: on the CPU, let glibc keep freed memory for the next step (unless
    ``keep`` is False, from ``train.keep_cpu_memory``), and log what was done.

    Not for a model that FSDP shards over several processes (``sharded``): it gathers and frees every block's
    parameters and gradients each step, and a heap that keeps freed blocks fragments under that pattern (several
    times the memory: ``benchmarks/`` measures it), which defeats sharding's purpose.
    """
    if not keep or device_type != "cpu":
        return
    if sharded:
        logger.debug("CPU memory: malloc left as configured (fsdp frees gathered blocks; a kept heap fragments)")
        return
    why_not = keep_freed_memory()
    if why_not is None:
        # Plumbing (the docs' CPU page says why): a debug line, not the first thing a run says.
        logger.debug("CPU memory: freed memory is kept for the next step (glibc mallopt; train.keep_cpu_memory)")
    else:
        logger.debug("CPU memory: malloc left as configured: %s", why_not)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """While training runs: the objects that exist now, after a collection, out of the garbage collector's passes
    (``gc.freeze``), so that a full pass walks only what training creates. In a process that was not frozen before
    (one process, a rank under torchrun, a notebook's ``fit``) they are the collector's again after; a worker forked
    from the fork server stays frozen (unfrozen, its next full pass would copy every page it shares with the
    server)."""
    frozen_before = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()
