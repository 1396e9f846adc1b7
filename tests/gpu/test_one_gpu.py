"""The one-GPU check's checks (benchmarks/gpu_check_one.py) as gpu tests, each in a fresh process: no CUDA context
and no process group in the pytest process, which later tests (launch(gpus=...)) need free. They are the GPU twins
of issue #44's CPU tests: loaded optimizer state and RNG keys on the CPU, files that load without CUDA, no sync in
the step, FSDP's offload group, the real out-of-memory retry, the memory plan against CUDA's count.
`python -m pytest -m gpu tests/gpu/test_one_gpu.py`; they skip on a machine without CUDA. The `--cpu` dry run of the
script (the checks that run on gloo) is in tests/test_benchmark_smoke.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, needs_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # they start processes: not in the fast tier
SCRIPT = REPO / "benchmarks" / "gpu_check_one.py"
CHECKS = [
    "nccl_ddp",
    "fsdp_offload",
    "dcp_sharded",
    "deterministic_resume",
    "no_sync_per_step",
    "micro_batch_oom",
    "memory_plan",
    "cpu_load_of_files",
    "sticky_cuda_error",
    "lost_gpu_nvml",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", CHECKS)
def test_one_gpu_check(check):
    needs_gpus(1)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", check], capture_output=True, text=True, timeout=280, cwd=REPO
    )
    assert out.returncode == 0 and out.stdout.startswith(f"PASS {check}"), out.stdout + out.stderr[-2000:]
