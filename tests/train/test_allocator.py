"""keep_freed_memory: glibc keeps what PyTorch frees, so a CPU step stops page-faulting its tensors in again.
The effect is measured in fresh interpreters (mallopt cannot be undone).
`python -m pytest tests/train/test_allocator.py`."""

import os
import platform
import subprocess
import sys

import pytest

from ignite_mgpu.train.allocator import keep_freed_memory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)

FAULTS_PER_STEP = """
import resource, statistics, sys, torch
from ignite_mgpu.train.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() is None
x = torch.ones(256, 64, 32, 32)  # 64 MiB, like a large activation; each step allocates and frees 2 like it
faults = []
for step in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = (x * 2).relu_() + x
    del y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The median step once the heap has grown to what the steps need (memalign leaves some blocks unused, and a block
# may still be faulted in late: one such step must not decide).
print(statistics.median(faults[8:]))
"""


def faults_per_step(mode):
    mine = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(mine)} | {"OMP_NUM_THREADS": "1"}  # glibc's defaults
    proc = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_STEP, mode], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout.split()[-1])


@glibc
@pytest.mark.slow  # two fresh interpreters importing torch
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    default, kept = faults_per_step("default"), faults_per_step("keep")
    # glibc mmaps each 64 MiB block and unmaps it on free: 16,384 faults a block with 4 KiB pages (32 with
    # transparent huge pages); kept, the blocks are reused and fault no more.
    assert default >= 32
    assert kept <= default / 30, (default, kept)


@pytest.mark.parametrize(
    "variable, value, reason",
    [
        ("MALLOC_TRIM_THRESHOLD_", "1000000", "MALLOC_TRIM_THRESHOLD_ already set"),
        ("MALLOC_MMAP_MAX_", "0", "MALLOC_MMAP_MAX_ already set"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1", "GLIBC_TUNABLES already set"),
        ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2", "another allocator is preloaded"),
    ],
)
def test_a_malloc_the_user_configured_is_left_alone(monkeypatch, variable, value, reason):
    for other in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setenv(variable, value)
    assert reason in keep_freed_memory()  # returns before calling mallopt: this process is unchanged


def test_other_platforms_are_left_alone(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert keep_freed_memory() == "not Linux with glibc"


def test_training_runs_with_the_heap_frozen_and_a_process_gets_it_back():
    # Run in a fresh interpreter: gc.freeze is process-wide, and this pytest process may be frozen already.
    code = """
import gc
from ignite_mgpu.train.allocator import frozen_heap
import torch
assert gc.get_freeze_count() == 0
with frozen_heap():
    inside = gc.get_freeze_count()
assert inside > 10000, inside  # torch's objects among them
assert gc.get_freeze_count() == 0  # a process that was not frozen gets its objects back
gc.freeze()  # a worker forked from the fork server: frozen at its start, and stays so
with frozen_heap():
    again = gc.get_freeze_count()
assert again > 10000 and gc.get_freeze_count() > again - 100  # not unfrozen (a few of its objects died)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
