"""--gpus from inside the workers: with a recorded 4-GPU snapshot injected, every spawned gloo worker sees
CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES set before it started. `python -m pytest tests/distributed`."""

import json
import os
from pathlib import Path

import ignite.distributed as idist
import pytest

from ignite_mgpu import launch
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import inventory

FOUR_A100 = [
    inventory.GpuInfo(i, f"00000000:{7 + i:02X}:00.0", "NVIDIA A100-SXM4-80GB", used, 81920, util, procs)
    for i, (used, util, procs) in enumerate([(70000, 95, 2), (30000, 40, 1), (500, 0, 0), (400, 0, 0)])
]


def report_environment(local_rank: int, out: str) -> None:
    keys = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    seen = {k: os.environ.get(k) for k in keys} | {"rank": idist.get_rank(), "world": idist.get_world_size()}
    Path(out, f"rank{local_rank}.json").write_text(json.dumps(seen))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec, expected", [("2,3", "2,3"), ("auto:2", "2,3"), ("3,1", "3,1")])
def test_workers_see_the_selected_gpus(tmp_path, monkeypatch, spec, expected):
    import torch

    monkeypatch.setattr(inventory, "query_gpus", lambda run=None: FOUR_A100)
    # The launcher's torch sees the 2 selected GPUs (the workers, on this CPU machine, see none and train on the CPU).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # launch() exports both into this process: restored after
    launch(report_environment, str(tmp_path), gpus=spec, backend="gloo")  # nproc defaults to the 2 GPUs chosen
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, env in enumerate(seen):
        assert env["CUDA_VISIBLE_DEVICES"] == expected and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert (env["rank"], env["world"], env["LOCAL_RANK"]) == (r, 2, str(r))


def test_bad_gpu_requests_fail_before_spawning(monkeypatch):
    monkeypatch.setattr(inventory, "query_gpus", lambda run=None: FOUR_A100)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match="GPU 5 requested; this machine has GPUs 0-3"):
        launch(report_environment, "/nonexistent", gpus="5", backend="gloo")
    with pytest.raises(ConfigError, match="--nproc 3"):
        launch(report_environment, "/nonexistent", gpus="2,3", nproc=3, backend="gloo")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        launch(report_environment, "/nonexistent", gpus="2,3", backend="gloo")


def report_device(local_rank: int, out: str) -> None:
    import torch

    device = idist.device()  # one process: ignite's serial model says "cuda", without an index
    seen = {"type": device.type, "index": torch.cuda.current_device(), "count": torch.cuda.device_count(),
            "name": torch.cuda.get_device_name(torch.cuda.current_device())}  # fmt: skip
    Path(out, f"rank{local_rank}.json").write_text(json.dumps(seen))


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_gpu_selection(tmp_path, monkeypatch):
    snapshot = inventory.query_gpus()
    if not snapshot:
        pytest.skip("nvidia-smi shows no GPU")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # launch() exports both: restored after the test
    last = snapshot[-1]
    launch(report_device, str(tmp_path), gpus=str(last.index))  # one GPU: a fresh spawned process sees only it
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen == {"type": "cuda", "index": 0, "count": 1, "name": last.name}
