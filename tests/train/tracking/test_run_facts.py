"""What the trackers record of a run besides its numbers: the flattened config, the physical GPUs (CUDA faked:
device objects and properties only), the git commit. `python -m pytest tests/train/tracking/test_run_facts.py`."""

import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from ignite_mgpu.config.loading import load_config
from ignite_mgpu.gpus.inventory import GpuInfo
from ignite_mgpu.train.tracking import run_facts


def test_the_config_flattens_into_dotted_parameters():
    params = run_facts.flat_config(load_config(overrides=["model.args.depth=3", "model.args.widths=[8,16]"]))
    assert params["optim.lr"] == "0.05" and params["train.epochs"] == "2" and params["model.name"] == "simple_cnn"
    assert params["model.args.depth"] == "3" and params["model.args.widths"] == "[8, 16]"
    assert params["resume"] == "null" and params["train.loggers"] == "[]" and params["dist.share"] == "false"
    assert all(isinstance(v, str) for v in params.values())


def test_each_gpu_is_named_by_its_physical_id_and_uuid(monkeypatch):
    props = {0: SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid="8a0e1c2d-0000-1111-2222-333344445555")}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props[index])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a0e1c2d-0000-1111-2222-333344445555")  # chosen by UUID
    snapshot = [
        GpuInfo(3, "00000000:07:00.0", "NVIDIA H100", 0, 81559, 0, 0, uuid="GPU-8a0e1c2d-0000-1111-2222-333344445555")
    ]
    monkeypatch.setattr(run_facts, "query_gpus", lambda: snapshot)
    (gpu,) = run_facts.job_gpus([torch.device("cuda", 0)])
    assert gpu["physical"] == "3" and gpu["uuid"] == "GPU-8a0e1c2d-0000-1111-2222-333344445555"  # as nvidia-smi
    assert run_facts.describe_gpus([gpu]).startswith("rank 0: GPU 3 NVIDIA H100 80GB HBM3 (GPU-8a0e1c2d-")
    monkeypatch.setattr(run_facts, "query_gpus", lambda: [])  # no NVML, no nvidia-smi: CUDA_VISIBLE_DEVICES says
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert run_facts.job_gpus([torch.device("cuda", 0)])[0]["physical"] == "5"
    assert run_facts.job_gpus([torch.device("cpu")]) == [] and run_facts.describe_gpus([]) == "none"


def test_the_code_version_is_the_git_commit_of_the_working_directory(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    assert run_facts.git_commit(str(tmp_path)) == (None, None)  # not a repository
    for var, value in (("GIT_AUTHOR_NAME", "t"), ("GIT_AUTHOR_EMAIL", "t@t"), ("GIT_COMMITTER_NAME", "t")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "t@t")
    (tmp_path / "train.py").write_text("print(1)\n")
    for args in (["init", "-q"], ["add", "train.py"], ["commit", "-qm", "first"]):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert run_facts.git_commit(str(tmp_path)) == (head, False)
    (tmp_path / "train.py").write_text("print(2)\n")
    assert run_facts.git_commit(str(tmp_path)) == (head, True)
    info = run_facts.run_facts(2, 1, [])
    assert info["processes"] == 2 and info["restarts"] == 1 and info["gpus"] == "none" and info["version"]
