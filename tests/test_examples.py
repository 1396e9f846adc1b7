"""Every example runs (tiny settings) so none can rot, and so do the commands of the tutorials and how-to guides
that run them. `python -m pytest tests/test_examples.py`."""

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO
from tests.docs_blocks import doc_block, run_block, sandbox
from tests.helpers import hugging_face

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def run_example(name, *args, timeout=150):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    script = str(REPO / "examples" / name)
    return subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO / "examples", env=env
    )


@pytest.mark.timeout(180)
def test_custom_training(tmp_path):
    result = run_example("custom_training.py", "--nproc", "2", "--epochs", "1", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(result.stdout.split("epoch 1:")[1].split("val_accuracy")[1].split()[0])
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


# The tutorials' and how-to guides' commands, run as the documentation writes them (tests/docs_blocks.py).


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(240)
def test_huggingface_gpt2_under_fsdp(tmp_path):
    hugging_face()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    result = run_block(doc_block("hf-gpt2"), sandbox(tmp_path), timeout=220)
    assert "block(s) of GPT2Block sharded over 2 processes" in result.stderr + result.stdout
    (line,) = metrics(tmp_path / "runs" / "gpt2")
    assert line["train_loss"] < 5.5 and line["val_loss"] < 5.5  # below chance over 256 bytes (ln 256 = 5.55)
    (best,) = (tmp_path / "runs" / "gpt2").glob("best_model_*.pt")
    args = yaml.safe_load((REPO / "examples/huggingface/gpt2.yaml").read_text())["model"]["args"]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**args))
    model.load_state_dict(torch.load(best, weights_only=True))
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied


@pytest.mark.timeout(240)
def test_huggingface_sequence_classifier(tmp_path):
    hugging_face()
    run_block(doc_block("hf-classifier"), sandbox(tmp_path), timeout=220)
    (line,) = metrics(tmp_path / "runs" / "classifier")
    assert 0 <= line["val_accuracy"] <= 1 and line["iteration"] == 4


@pytest.mark.timeout(200)
def test_timm_vit(tmp_path):
    pytest.importorskip("timm")
    run_block(doc_block("timm-vit"), sandbox(tmp_path), timeout=180)
    (line,) = metrics(tmp_path / "runs" / "vit")
    assert line["iteration"] == 4 and "val_accuracy" in line
