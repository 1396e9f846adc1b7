"""Every example runs (tiny settings) so none can rot. `python -m pytest tests/test_examples.py`."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.distributed]


def run_example(name, *args, timeout=150):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    script = str(REPO / "examples" / name)
    return subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO / "examples", env=env
    )


@pytest.mark.timeout(180)
def test_custom_training(tmp_path):
    result = run_example("custom_training.py", "--nproc", "2", "--epochs", "3", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(result.stdout.split("epoch 3:")[1].split("val_accuracy")[1].split()[0])
    assert accuracy > 0.85
    assert "it loads into the unwrapped model" in result.stdout


@pytest.mark.timeout(180)
def test_loss_in_forward_ddp():
    result = run_example("loss_in_forward.py", "--nproc", "2", "--epochs", "3", "--samples", "1000")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines() if "loss" in line]
    assert len(losses) == 3 and losses[-1] < losses[0] / 5
    assert "all input tensors were scalars" not in result.stderr


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_loss_in_forward_dataparallel():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for DataParallel to split the batch")
    result = run_example("loss_in_forward.py", "--strategy", "dp", "--epochs", "3", "--batch-size", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LossDataParallel" in result.stdout
    assert "all input tensors were scalars" not in result.stderr


@pytest.mark.timeout(180)
def test_readme_in_your_own_code_snippet(tmp_path):
    readme = (REPO / "README.md").read_text()
    snippet = readme.split("## In your own code")[1].split("```python")[1].split("```")[0]
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if "train_loss" in line)
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], result.stdout
    assert len({line.split("train_loss ")[1] for line in lines}) == 1  # the epoch mean over ranks, on every rank
