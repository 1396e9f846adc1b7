"""GPU claims on real GPUs (the twins of tests/gpus/test_claims.py, which use the stand-in nvidia-smi): NVML
and nvidia-smi name every GPU by its UUID, a plan on a GPU claims it by that UUID, and a second job is refused it
and sees who holds it. `python -m pytest -m gpu tests/gpu/test_claims.py`; they skip on a machine without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, cuda_device_count, needs_gpus, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # they start processes: not in the fast tier
CLAIMER = REPO / "tests" / "processes" / "claimer.py"


def test_every_real_gpu_has_a_uuid_from_nvml_and_nvidia_smi():
    from ignite_mgpu.gpus import inventory

    needs_gpus(1)
    by_nvml, by_smi = inventory.query_gpus(), inventory.query_gpus(inventory._run_nvidia_smi)
    assert all(g.uuid.startswith("GPU-") for g in by_smi), by_smi
    assert [g.uuid for g in by_nvml] == [g.uuid for g in by_smi]


@pytest.mark.timeout(180)
def test_a_plan_on_a_real_gpu_claims_it_and_a_second_job_is_refused_it():
    needs_gpus(1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, str(CLAIMER), "--gpus", "0", "--hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        got = json.loads(holder.stdout.readline())
        assert got["gpus"] == [0] and got["claimed"][0].startswith("GPU-")
        code = (
            "from ignite_mgpu.config.schema import DistConfig; from ignite_mgpu.processes.plan import make_plan\n"
            "plan, held = make_plan(DistConfig(gpus='auto:1')); print(plan.gpus, held.names)"
        )
        second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        if cuda_device_count() > 1:  # another GPU: auto takes it, by its own UUID
            assert second.returncode == 0 and not second.stdout.startswith("[0]"), second.stderr[-2000:]
        else:
            assert "needs 1 GPU that no other job has, but 0 of the 1 are left: GPU 0 is claimed by" in second.stderr
        devices = json.loads(run_cli(["devices", "--json"], REPO, timeout=60).stdout)
        assert devices["gpus"][0]["claim"]["pid"] == holder.pid
    finally:
        holder.stdin.close()
        holder.wait(30)
