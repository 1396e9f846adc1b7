"""Every CUDA path, on real GPUs: `python -m pytest -m gpu` (benchmarks/gpu_check.sh runs them with the rest of the
one-shot GPU check). One GPU runs most of them; those that need two skip with a reason. Each job is the real CLI in
a subprocess with small data and a hard timeout; they skip on a machine without CUDA."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, cuda_device_count, needs_gpus, run_cli, run_fresh

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # they start processes: not in the fast tier
FAULTS = REPO / "tests" / "faults"


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_state(out: Path) -> dict:
    from ignite_mgpu.checkpoint.files import list_checkpoints, read_checkpoint

    return read_checkpoint(list_checkpoints(out)[0])


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """The default job (small data) on one GPU in fp32, then resumed for a third epoch: shared by several tests."""
    needs_gpus(1)
    tmp = tmp_path_factory.mktemp("fp32")
    out = tmp / "run"
    first = run_cli(["train", *TINY, "--nproc", "1", "--output-dir", str(out)], tmp, timeout=240)
    resumed = run_cli(
        ["train", *TINY, "--output-dir", str(out), "--resume", "auto", "train.epochs=3"], tmp, timeout=240
    )
    return out, first, resumed


@pytest.mark.timeout(600)
def test_one_gpu_trains_reports_cuda_memory_and_resumes(fp32_run):
    out, first, resumed = fp32_run
    assert first.returncode == 0, first.stderr[-3000:]
    assert "device cuda" in first.stderr
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[-1]["val_accuracy"] > 0.5
    # The CUDA branch of the report: torch.cuda.max_memory_allocated of the one GPU, far below the process's RSS.
    assert len(rows[-1]["peak_memory_mb"]) == 1 and 0 < rows[-1]["peak_memory_mb"][0] < 2000
    ckpt = final_state(out)
    assert all(t.device.type == "cpu" for t in ckpt["model"].values())  # read_checkpoint maps to the CPU


@pytest.mark.timeout(300)
def test_evaluate_on_a_gpu_scores_like_the_run(fp32_run):
    out, *_ = fp32_run
    (best,) = out.glob("best_model_*.pt")
    ev = run_cli(["evaluate", *TINY, "--checkpoint", str(best), "--json"], out.parent, timeout=240)
    assert ev.returncode == 0, ev.stderr[-3000:]
    scored = json.loads(ev.stdout.strip().splitlines()[-1])
    assert scored["samples"] == 101
    assert scored["accuracy"] == pytest.approx(max(r["val_accuracy"] for r in metrics(out)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_a_gpu(tmp_path, precision):
    needs_gpus(1)
    out = tmp_path / "run"
    result = run_cli(["train", *TINY, "--nproc", "1", f"train.precision={precision}", "--output-dir", str(out)],
                     tmp_path, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "before `optimizer.step()`" not in result.stderr  # fp16: skipped steps do not advance the schedule
    rows = metrics(out)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and rows[-1]["val_accuracy"] > 0.5
    scaler = final_state(out)["scaler"]
    assert (scaler != {}) == (precision == "fp16")  # only fp16 uses (and saves) a GradScaler


@pytest.mark.timeout(600)
def test_deterministic_runs_on_a_gpu_are_bitwise_identical_and_resume_exactly(tmp_path):
    needs_gpus(1)
    args = [*TINY, "--nproc", "1", "train.deterministic=true", "checkpoint.every_iters=4", "checkpoint.n_saved=10"]
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        result = run_cli(["train", *args, "--output-dir", str(out)], tmp_path, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
    resumed = tmp_path / "resumed"
    result = run_cli(["train", *args, "--output-dir", str(resumed), "--resume", str(a / "checkpoint_12.pt")],
                     tmp_path, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    import torch

    reference = final_state(a)["model"]
    for other in (b, resumed):
        state = final_state(other)["model"]
        assert all(torch.equal(reference[k], state[k]) for k in reference), other


@pytest.mark.timeout(300)
def test_compiled_model_on_a_gpu_saves_plain_keys(tmp_path):
    needs_gpus(1)
    out = tmp_path / "run"
    result = run_cli(["train", *TINY, "--nproc", "1", "model.compile=true", "--output-dir", str(out)], tmp_path,
                     timeout=280)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [k for k in final_state(out)["model"] if k.startswith(("_orig_mod.", "module."))]


@pytest.mark.timeout(300)
def test_chosen_gpu_and_no_stray_contexts(tmp_path):
    """--gpus <last>: the job runs on that card only, and the launching process holds no CUDA context anywhere."""
    needs_gpus(1)
    from ignite_mgpu.gpus import inventory

    snapshot = inventory.query_gpus()
    last = snapshot[-1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "ignite_mgpu", "train", *TINY, "train.epochs=4", "--gpus", str(last.index)]
    proc = subprocess.Popen([*cmd, "--output-dir", str(tmp_path / "run")], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    seen: set[tuple[str, int]] = set()
    ours = {proc.pid}

    def sample() -> None:
        import psutil

        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                ours.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid", "--format=csv,noheader"],
                                  capture_output=True, text=True).stdout  # fmt: skip
            seen.update(
                (inventory._bus(b), int(p)) for b, p in (ln.split(",") for ln in apps.splitlines() if "," in ln)
            )
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate(timeout=280)
    sampler.join(5)
    assert proc.returncode == 0, err[-3000:]
    assert f"is physical GPU {last.index}" in err
    on_gpus = {(bus, pid) for bus, pid in seen if pid in ours}
    assert on_gpus, "nvidia-smi never showed the job's worker"
    assert {bus for bus, _ in on_gpus} == {last.pci_bus_id}  # on the chosen card only
    assert proc.pid not in {pid for _, pid in on_gpus}  # the launcher never created a CUDA context


@pytest.mark.timeout(120)
def test_nvml_agrees_with_nvidia_smi():
    needs_gpus(1)
    pytest.importorskip("pynvml")
    from ignite_mgpu.gpus import inventory

    by_nvml = inventory._query_nvml()
    by_smi = inventory.query_gpus(inventory._run_nvidia_smi)
    assert by_nvml is not None
    assert [(g.index, g.pci_bus_id, g.name, g.mig) for g in by_nvml] == [
        (g.index, g.pci_bus_id, g.name, g.mig) for g in by_smi
    ]


@pytest.mark.timeout(120)
def test_loaders_pin_memory_and_copies_are_non_blocking_on_cuda(tmp_path, monkeypatch):
    needs_gpus(1)
    code = (
        "import torch, ignite.distributed as idist\n"
        "from ignite_mgpu.config.loading import load_config\n"
        "from ignite_mgpu.train.data.loaders import create_dataloaders\n"
        "cfg = load_config(overrides=['data.train_size=64', 'data.val_size=16', 'data.batch_size=16'])\n"
        "train, val = create_dataloaders(cfg.data, 10, 0)\n"
        "x, y = next(iter(train))\n"
        "print(idist.device().type, train.pin_memory, val.pin_memory, x.is_pinned())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert out.stdout.split() == ["cuda", "True", "True", "True"], out.stderr[-2000:]


# ----------------------------------------------------------------------------------------------- 2 GPUs


@pytest.mark.timeout(300)
def test_nccl_on_two_gpus_maps_ranks_to_physical_gpus(tmp_path):
    needs_gpus(2)
    out = tmp_path / "run"
    result = run_cli(["train", *TINY, "--gpus", "1,0", "--output-dir", str(out)], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend nccl" in result.stderr
    assert "cuda:0 is physical GPU 1" in result.stderr and "cuda:1 is physical GPU 0" in result.stderr
    assert len(metrics(out)[-1]["peak_memory_mb"]) == 2


@pytest.mark.timeout(300)
def test_gloo_on_two_gpus_puts_each_rank_on_its_own_gpu(tmp_path):
    """The worker creates the group itself (a FileStore): each rank's current device is still its own, as ignite
    sets it, with gloo too."""
    needs_gpus(2)
    out = tmp_path / "run"
    args = ["train", *TINY, "--gpus", "1,0", "--backend", "gloo", "--output-dir", str(out)]
    result = run_cli(args, tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend gloo" in result.stderr
    assert "cuda:0 is physical GPU 1" in result.stderr and "cuda:1 is physical GPU 0" in result.stderr


@pytest.mark.timeout(300)
def test_dataparallel_reports_every_gpu_and_syncbatchnorm_trains(tmp_path):
    needs_gpus(2)
    dp = run_cli(["train", *TINY, "--strategy", "dp", "--gpus", "0,1", "--output-dir", str(tmp_path / "dp")],
                 tmp_path, timeout=240)  # fmt: skip
    assert dp.returncode == 0, dp.stderr[-3000:]
    row = metrics(tmp_path / "dp")[-1]
    assert len(row["peak_memory_mb"]) == 2 and row["memory_imbalance"] >= 1.0  # GPU 0 gathers: usually higher
    sbn = run_cli(["train", *TINY, "model.name=resnet18", "model.sync_batchnorm=true", "--gpus", "0,1",
                   "--output-dir", str(tmp_path / "sbn")], tmp_path, timeout=240)  # fmt: skip
    assert sbn.returncode == 0, sbn.stderr[-3000:]


def dataparallel_loss_difference() -> float:
    """DataParallel's loss vector reduced on 2 GPUs against the loss on the CPU (called in a fresh process)."""
    import torch
    from torch import nn

    from ignite_mgpu.parallel.strategy import prepare_model, reduce_replica_losses

    class LossModel(nn.Linear):
        def forward(self, x, y):
            return nn.functional.cross_entropy(super().forward(x), y)

    torch.manual_seed(0)
    model = LossModel(6, 3)
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))  # 7 on 2 GPUs: 4/3
    expected = model(x, y)
    dp = prepare_model(model, strategy="dp")
    got = reduce_replica_losses(dp(x.cuda(), y.cuda()), dp, len(x))
    return float((got.cpu() - expected).abs())


@pytest.mark.timeout(300)
def test_dataparallel_reduces_the_loss_vector_exactly_on_gpus():
    needs_gpus(2)
    # In a fresh process: CUDA started here would make a later launch(gpus=...) test refuse.
    difference, _ = run_fresh("tests.gpu.test_cuda:dataparallel_loss_difference")
    assert difference <= 1e-5


@pytest.mark.timeout(300)
def test_nccl_timeout_names_the_rank_that_never_arrived(tmp_path):
    needs_gpus(2)
    args = ["train", "--nproc", "2", "--timeout", "20", "model.name=faultmod:make", "data.train_size=640",
            "data.batch_size=64", "train.check_every=1", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    env = {"FAULT": "sleep:1:3", "PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}"}
    result = run_cli(args, tmp_path, timeout=200, env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "rank(s) 1" in result.stderr and ("never arrived" in result.stderr or "stopped answering" in result.stderr)


@pytest.mark.timeout(300)
def test_scale_measures_the_step_on_gpus_with_cuda_events(tmp_path):
    # ignite-mgpu scale on the GPUs there are (up to 2): the CUDA-event path of the step split, every size's claims.
    needs_gpus(1)
    gpus = min(2, cuda_device_count())
    ids = ",".join(map(str, range(gpus)))
    out = run_cli(["scale", *TINY, "--gpus", ids, "--iters", "10", "--json"], tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["device"] == "cuda" and [s["devices"] for s in report["sizes"]] == list(range(1, gpus + 1))
    one = report["sizes"][0]
    assert one["samples_per_s"] > 0 and one["step_ms"]["compute"] > 0  # read from CUDA events, not zero
    assert (report["published"] is not None) == (gpus > 1)
    assert list(tmp_path.iterdir()) == []
