"""train.micro_batch on 2 real gloo processes, with a real out-of-memory error: rank 1's address space is capped
(RLIMIT_AS, set by the model factory tests.plugins_pkg.factories:capped_mlp) so that its share of the batch does not
fit. One spawned job trains every configuration in turn. `python -m pytest tests/distributed/test_micro_batch.py -q`."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

from ignite_mgpu import launch
from ignite_mgpu.checkpoint.files import list_checkpoints, read_checkpoint
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.parallel import fsdp
from ignite_mgpu.train.default_job import training
from tests.conftest import run_cli
from tests.helpers import cpu_fsdp

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
# 256 samples in global batches of 32: 16 per process, 8 iterations an epoch (3 epochs: past auto's 20 iterations
# of settling, so both of its sync paths run). Rank 1 may hold 1500 MB more than at
# its first training forward, and every sample asks for 128 MB: 16 (2 GB) do not fit, 8 (1 GB) do, with room left for
# what the process maps later (thread arenas, FSDP's buffers). Address space only: the scratch is never touched.
JOB = [
    "model.name=tests.plugins_pkg.factories:capped_mlp",
    "data.image_size=8", "data.train_size=256", "data.val_size=32", "data.batch_size=32", "data.shuffle=false",
    "train.check_every=4", "train.progress_bar=false", "train.epochs=3",
]  # fmt: skip
CAPPED = ["model.args.capped_rank=1"]


def config(out: Path, *extra: str):
    return load_config(overrides=[*JOB, f"output_dir={out}", *extra])


def final_model(out: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(list_checkpoints(out)[0])["model"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# FSDP over gloo needs PyTorch 2.6 (tests/helpers.py cpu_fsdp): before it, those two runs are left out.
FSDP_JOBS = (
    [
        ("fsdp-whole", ["dist.strategy=fsdp", "train.grad_accum_steps=2"]),
        ("fsdp-parts", ["dist.strategy=fsdp", "train.grad_accum_steps=2", "train.micro_batch=3"]),
    ]
    if fsdp.runs_on_cpu()
    else []
)


def micro_batch_jobs(local_rank: int, root: str) -> None:
    """Every configuration, one after the other in the same two processes (the cap is lifted after each capped run)."""
    limit, root_ = resource.getrlimit(resource.RLIMIT_AS), Path(root)
    for name, extra in (
        ("auto", ["train.micro_batch=auto", *CAPPED]),
        ("eight", ["train.micro_batch=8"]),
        ("whole", []),
        *FSDP_JOBS,
    ):
        training(local_rank, config(root_ / name, *extra))
        resource.setrlimit(resource.RLIMIT_AS, limit)


def assert_within(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert list(a) == list(b)
    for key in a:
        diff = (a[key] - b[key]).abs().max().item()
        assert diff <= atol, f"{key}: max difference {diff:.2e} > {atol:.0e}"


@pytest.mark.timeout(300)
def test_auto_survives_one_ranks_real_out_of_memory_and_parts_train_like_whole_batches(tmp_path):
    launch(micro_batch_jobs, str(tmp_path), nproc=2, backend="gloo")
    auto = tmp_path / "auto"
    assert [row["micro_batch"] for row in metrics(auto)] == [8, 8, 8]  # rank 1 ran out with 16: both use 8
    assert json.loads((auto / "micro_batch.json").read_text()) == {"micro_batch": 8}
    assert "micro_batch" not in metrics(tmp_path / "whole")[-1]  # null: metrics.jsonl as before
    eight, whole = final_model(tmp_path / "eight"), final_model(tmp_path / "whole")
    assert_within(final_model(auto), eight)
    assert_within(eight, whole)
    if FSDP_JOBS:
        assert_within(final_model(tmp_path / "fsdp-parts"), final_model(tmp_path / "fsdp-whole"))


@cpu_fsdp
@pytest.mark.timeout(240)
def test_an_out_of_memory_inside_fsdp_collectives_restarts_from_the_remembered_size(tmp_path):
    # Under FSDP every forward gathers parameters: rank 1 cannot retry while rank 0 waits in that collective, so
    # it remembers the smaller size and fails; the job restarts (dist.max_restarts) and both ranks start from 8
    # (a restart and --resume auto read micro_batch.json alike: MicroBatching, when the trainer is created).
    out = tmp_path / "run"
    args = [*JOB, *CAPPED, "train.micro_batch=auto", "train.epochs=1", "dist.max_restarts=1"]
    result = run_cli(["train", "--nproc", "2", "--strategy", "fsdp", "--output-dir", str(out), *args], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restart" in result.stderr.lower() and "MicroBatchTooLarge" in result.stderr
    assert json.loads((out / "micro_batch.json").read_text()) == {"micro_batch": 8}
    assert [row["micro_batch"] for row in metrics(out)] == [8] and metrics(out)[-1]["restarts"] == 1
