"""A checkpoint of 2 CPU processes resumed on the GPUs, under DDP on one GPU and under DataParallel, mid-epoch: the
same run as the uninterrupted CPU run up to the rounding of another device. `python -m pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import cpu_only, needs_gpus, run_cli
from tests.distributed.test_any_process_count import ARGS, final_weights

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
FP32 = [*ARGS, "train.precision=fp32"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "dp"])
def test_a_cpu_checkpoint_resumed_mid_epoch_on_gpus_is_the_same_run(tmp_path, strategy):
    needs_gpus(1)
    cpu = tmp_path / "cpu"
    with cpu_only(tmp_path / "claims"):
        result = run_cli(["train", *FP32, "--nproc", "2", "--output-dir", str(cpu)], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    gpu = tmp_path / "gpu"
    args = ["train", *FP32, "--strategy", strategy, "--gpus", "auto:1", "--output-dir", str(gpu)]
    result = run_cli([*args, "--resume", str(cpu / "checkpoint_6.pt")], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    want, got = final_weights(cpu), final_weights(gpu)
    for key, value in want.items():  # CUDA's kernels round otherwise than the CPU's
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-4, msg=f"cpu on 2 -> {strategy} on a GPU: {key}")
