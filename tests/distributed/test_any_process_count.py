"""A run stopped mid-epoch on 2 processes and resumed on 1, 2 or 3 (and one of 1 on 2) is the same run: the same
global batches (64, uneven over 3: 22 + 21 + 21), the same schedule, weights within 1e-5 of the uninterrupted run
(bit-identical on 2), for DDP (whole batches and in parts) and FSDP, full and sharded checkpoints.
`python -m pytest tests/distributed/test_any_process_count.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ignite_mgpu.checkpoint.files import read_checkpoint
from ignite_mgpu.checkpoint.tools import convert
from ignite_mgpu.parallel import fsdp
from tests.conftest import cpu_only, run_cli
from tests.helpers import cpu_fsdp

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# An MLP (no random, no batch-dependent layer) on 320 synthetic images in global batches of 64: 5 iterations an
# epoch, 2 epochs, a checkpoint every 3 iterations (3 and 6 mid-epoch, 9, the 10th at the end), all kept.
ARGS = [
    "model.name=mlp",
    "data.train_size=320",
    "data.val_size=50",
    "data.image_size=8",
    "data.batch_size=64",
    "train.epochs=2",
    "train.check_every=1",
    "checkpoint.every_iters=3",
    "checkpoint.n_saved=10",
]
FSDP = ["--strategy", "fsdp", "optim.name=adamw"]
SETTINGS = {
    "ddp": [],
    "ddp-parts": ["train.micro_batch=8"],  # each process's share in parts of 8 (22 = 8 + 8 + 6)
    "fsdp-full": FSDP,
    "fsdp-sharded": [*FSDP, "checkpoint.format=sharded"],
}


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    """The model of the run's last checkpoint, a file or a sharded folder (gathered)."""
    path = out / "checkpoint_10.pt"
    if path.exists():
        return read_checkpoint(path)["model"]
    convert(out / "checkpoint_10", out / "final.pt")
    return torch.load(out / "final.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """Each setting's uninterrupted 2-process run, whose mid-epoch checkpoint_6 the tests resume."""
    root = tmp_path_factory.mktemp("reference")
    runs = {}
    with cpu_only(root / "claims"):
        for name, extra in SETTINGS.items():
            if name.startswith("fsdp") and not fsdp.runs_on_cpu():
                continue  # its tests skip (cpu_fsdp)
            out = root / name
            result = run_cli(["train", *ARGS, *extra, "--nproc", "2", "--output-dir", str(out)], root, timeout=180)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[name] = out
    return runs


def resumed(reference: Path, extra: list[str], nproc: int, tmp_path: Path) -> Path:
    out = tmp_path / f"on{nproc}"
    target = reference / "checkpoint_6.pt" if (reference / "checkpoint_6.pt").exists() else reference / "checkpoint_6"
    args = ["train", *ARGS, *extra, "--nproc", str(nproc), "--output-dir", str(out), "--resume", str(target)]
    result = run_cli(args, tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "setting, counts",
    [
        ("ddp", (2, 1, 3)),
        ("ddp-parts", (3,)),
        pytest.param("fsdp-full", (1, 3), marks=cpu_fsdp),
        pytest.param("fsdp-sharded", (1, 3), marks=cpu_fsdp),
    ],
)
def test_a_run_resumed_mid_epoch_on_another_process_count_is_the_same_run(reference, tmp_path, setting, counts):
    want = final_weights(reference[setting])
    for nproc in counts:
        got = final_weights(resumed(reference[setting], SETTINGS[setting], nproc, tmp_path))
        for key, value in want.items():
            if nproc == 2:
                assert torch.equal(got[key], value), key
            else:  # the same samples, summed in another order
                torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=f"{setting} on {nproc}: {key}")


@pytest.mark.timeout(300)
def test_a_one_process_run_resumed_on_two_is_the_same_run(tmp_path):
    with cpu_only(tmp_path / "claims"):
        alone = tmp_path / "alone"
        result = run_cli(["train", *ARGS, "--nproc", "1", "--output-dir", str(alone)], tmp_path, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        want, got = final_weights(alone), final_weights(resumed(alone, [], 2, tmp_path))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=f"1 -> 2: {key}")


@cpu_fsdp
@pytest.mark.timeout(300)
def test_an_fsdp_checkpoint_resumed_under_ddp_on_another_count_is_the_same_run(reference, tmp_path):
    want = final_weights(reference["fsdp-full"])
    got = final_weights(resumed(reference["fsdp-full"], ["optim.name=adamw"], 3, tmp_path))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=f"fsdp on 2 -> ddp on 3: {key}")


@pytest.mark.timeout(400)
def test_a_deterministic_run_resumed_mid_epoch_on_three_is_the_same_run(tmp_path):
    """ignite's DeterministicEngine replays the resumed epoch's first global batches itself: on 3 processes it skips
    the same global batches the 2-process run had trained, and goes on with the same samples."""
    extra = ["train.deterministic=true"]
    with cpu_only(tmp_path / "claims"):
        two = tmp_path / "two"
        result = run_cli(["train", *ARGS, *extra, "--nproc", "2", "--output-dir", str(two)], tmp_path, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        want, got = final_weights(two), final_weights(resumed(two, extra, 3, tmp_path))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=f"deterministic 2 -> 3: {key}")


@pytest.mark.timeout(300)
def test_a_resume_mid_epoch_of_an_explicit_epoch_length_says_samples_may_repeat(tmp_path):
    """train.epoch_length other than the data's batches has no sample position to resume at: said once, on rank 0."""
    args = [*ARGS, "train.epoch_length=4", "train.epochs=1", "checkpoint.every_iters=2"]
    with cpu_only(tmp_path / "claims"):
        first = tmp_path / "first"
        result = run_cli(["train", *args, "--nproc", "2", "--output-dir", str(first)], tmp_path, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        again = tmp_path / "again"
        resume = ["--resume", str(first / "checkpoint_2.pt"), "--output-dir", str(again)]
        result = run_cli(["train", *args, "--nproc", "2", *resume], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("some of its samples may repeat") == 1, result.stderr[-3000:]
    assert "resumed at iteration 2 of an epoch of 4 iterations (as the checkpoint counts it" in result.stderr
    assert "not the data's 5 global batches now" in result.stderr
