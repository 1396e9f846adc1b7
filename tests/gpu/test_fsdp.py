"""Every CUDA path of `--strategy fsdp`, on two real GPUs with nccl: `python -m pytest -m gpu tests/gpu/test_fsdp.py`
(benchmarks/gpu_check.sh runs them). Each needs 2 GPUs (FSDP on one process shards nothing) and skips otherwise:
fp32/bf16/fp16 (FSDP's mixed precision, fp16 through the GradScaler), CPU offload, full and sharded checkpoints
resumed on GPUs and across strategies, evaluation on GPUs. The memory table (DDP vs FSDP vs DP per GPU) is
benchmarks/fsdp/bench_fsdp_memory.py --gpus 0,1, which gpu_check.sh runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY, needs_gpus, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # they start processes: not in the fast tier
FSDP = ["--strategy", "fsdp", "--gpus", "0,1", "model.name=resnet18", "data.image_size=32"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fsdp_trains_on_two_gpus_in_every_precision(tmp_path, precision):
    needs_gpus(2)
    out = tmp_path / "run"
    result = run_cli(["train", *TINY, *FSDP, f"train.precision={precision}", "train.clip_grad_norm=1.0",
                      "train.grad_accum_steps=2", "checkpoint.every_iters=0", "--output-dir", str(out)],
                     tmp_path, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device cuda" in result.stderr and "block(s) of BasicBlock sharded over 2 processes" in result.stderr
    assert "before `optimizer.step()`" not in result.stderr  # fp16: skipped steps do not advance the schedule
    rows = metrics(out)
    assert len(rows[-1]["peak_memory_mb"]) == 2 and rows[-1]["peak_memory_per"] == "gpu"
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]


@pytest.mark.timeout(600)
def test_fsdp_cpu_offload_and_both_checkpoint_formats_resume_on_gpus(tmp_path):
    needs_gpus(2)
    for fmt, extra in (("full", ["model.fsdp_cpu_offload=true"]), ("sharded", [])):
        out = tmp_path / fmt
        args = ["train", *TINY, *FSDP, *extra, f"checkpoint.format={fmt}", "--output-dir", str(out)]
        first = run_cli(args, tmp_path, timeout=300)
        assert first.returncode == 0, first.stderr[-3000:]
        resumed = run_cli([*args, "--resume", "auto", "train.epochs=3"], tmp_path, timeout=300)
        assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
        assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
        # Issue #44 (5): under CPU offload too, the memory figures are the GPUs' (the parameters are on the CPU).
        assert all(r["peak_memory_per"] == "gpu" and len(r["peak_memory_mb"]) == 1 for r in metrics(out))
    # Issue #44 (3): every file of the GPU run reads onto the CPU with plain torch.load (no map_location).
    import torch

    for path in tmp_path.rglob("*.pt"):
        state = torch.load(path, weights_only=True, map_location=None)
        assert all(t.device.type == "cpu" for t in torch.utils._pytree.tree_leaves(state) if torch.is_tensor(t))
    # The full FSDP checkpoint resumes under DDP on the GPUs, and its best model evaluates on one GPU.
    ddp = run_cli(["train", *TINY, "--gpus", "0,1", "model.name=resnet18", "--output-dir", str(tmp_path / "ddp"),
                   "--resume", str(sorted((tmp_path / "full").glob("checkpoint_*.pt"))[-1]), "train.epochs=4"],
                  tmp_path, timeout=300)  # fmt: skip
    assert ddp.returncode == 0 and "resumed from" in ddp.stderr, ddp.stderr[-3000:]
    (best,) = (tmp_path / "sharded").glob("best_model_*.pt")
    ev = run_cli(["evaluate", *TINY, *FSDP, "--checkpoint", str(best), "--json"], tmp_path, timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    scored = json.loads(ev.stdout.strip().splitlines()[-1])
    assert scored["samples"] == 101  # 51 + 50 on two GPUs, the second padded with a forward
    assert scored["accuracy"] == pytest.approx(max(r["val_accuracy"] for r in metrics(tmp_path / "sharded")))
