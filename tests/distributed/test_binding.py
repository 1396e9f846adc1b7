"""--cpu-binding in real 2-process gloo jobs: each rank and its loader workers run on the rank's share with its
threads (the process group's threads on the job's CPUs), binding leaves the weights bit for bit as they were, and a
restricted affinity is kept.

Run: python -m pytest tests/distributed/test_binding.py -q   (needs 2 CPUs; each test has a hard timeout)
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import torch

from ignite_mgpu import launch
from ignite_mgpu.checkpoint.files import list_checkpoints, read_checkpoint
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.cpus.binding import plan_for_job
from ignite_mgpu.cpus.topology import parse_cpulist
from ignite_mgpu.train.default_job import training
from tests.conftest import run_cli

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: one per rank"),
]
TINY_MLP = [
    "model.name=mlp",
    "data.image_size=8",
    "data.train_size=256",
    "data.val_size=64",
    "data.batch_size=32",
    "train.epochs=1",
    "train.check_every=4",
]


def _write_affinity(path: str, worker_id: int) -> None:
    Path(path).write_text(json.dumps(sorted(os.sched_getaffinity(0))))


def record_binding(local_rank: int, out: str) -> None:
    """The job: every thread's name and CPUs (gloo's too, started after the binding), the intra-op threads, and the
    CPUs of a data-loader worker this rank forks."""
    from torch.utils.data import DataLoader, TensorDataset

    masks = {}
    for tid in os.listdir("/proc/self/task"):
        status = Path(f"/proc/self/task/{tid}/status").read_text().splitlines()
        mask = next(line.split(":", 1)[1].strip() for line in status if line.startswith("Cpus_allowed_list"))
        name = "main" if int(tid) == os.getpid() else Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        masks[f"{name} {tid}"] = mask
    loader_file = Path(out, f"loader{local_rank}.json")
    ds = TensorDataset(torch.zeros(4, 1))
    list(DataLoader(ds, batch_size=2, num_workers=1, worker_init_fn=partial(_write_affinity, str(loader_file))))
    seen = {"masks": masks, "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}
    Path(out, f"rank{local_rank}.json").write_text(json.dumps(seen))


@pytest.mark.timeout(120)
def test_each_rank_and_its_loader_workers_run_on_its_share(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    expected = plan_for_job("cores", 2, None, False, "ddp", {})
    # By name, as the CLI starts jobs: torch is first imported in the worker after the binding.
    launch("tests.distributed.test_binding:record_binding", str(tmp_path), nproc=2, backend="gloo", cpu_binding="cores")
    err = capfd.readouterr().err
    assert "ignite-mgpu: cpu binding: cores (as asked)" in err
    for r in (0, 1):
        want = expected.ranks[r]
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        masks = {name: set(parse_cpulist(mask)) for name, mask in seen["masks"].items()}
        group = {name for name in masks if name.startswith(("gloo_tcp_loop", "pt_gloo_runloop", "pt_tcpstore"))}
        assert group and all(masks[name] == os.sched_getaffinity(0) for name in group), seen  # on the job's CPUs
        assert all(mask == set(want.cpus) for name, mask in masks.items() if name not in group), seen  # main too
        assert seen["threads"] == want.threads and seen["omp"] == str(want.threads)
        assert json.loads((tmp_path / f"loader{r}.json").read_text()) == list(want.cpus)
        assert f"rank {r}: {want.describe()}" in err  # each rank's first line


def final_model(out: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(list_checkpoints(out)[0])["model"]


@pytest.mark.timeout(180)
def test_binding_never_changes_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same thread count with and without binding (cores keeps it)
    for mode in ("none", "cores"):
        cfg = load_config(overrides=[*TINY_MLP, f"output_dir={tmp_path / mode}"])
        launch(training, cfg, nproc=2, backend="gloo", cpu_binding=mode)
    unbound, bound = final_model(tmp_path / "none"), final_model(tmp_path / "cores")
    assert unbound.keys() == bound.keys()
    for key in unbound:
        a, b = unbound[key].contiguous(), bound[key].contiguous()
        assert a.view(torch.uint8).equal(b.view(torch.uint8)), key  # bit for bit


@pytest.mark.timeout(120)
def test_a_restricted_affinity_is_kept(tmp_path):
    args = [*TINY_MLP, "model.name=tests.distributed.probe:make", "--nproc", "2", "--backend", "gloo"]
    cpu, before = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # the CLI starts as under `taskset -c <cpu>`: children inherit the mask
    try:
        auto = run_cli(["train", *args, "--cpu-binding", "auto", "--output-dir", "auto"], tmp_path)
        cores = run_cli(["train", *args, "--cpu-binding", "cores", "--output-dir", "cores"], tmp_path)
    finally:
        os.sched_setaffinity(0, before)
    assert auto.returncode == 0, auto.stderr
    assert f"cpu binding: none (auto: the job's affinity is already restricted to CPUs {cpu})" in auto.stderr
    for r in (0, 1):
        assert json.loads((tmp_path / f"probe-rank{r}.json").read_text())["affinity"] == [cpu]  # never widened
    assert cores.returncode == 2, cores.stderr
    assert cores.stderr.startswith(
        "ignite-mgpu: error: --cpu-binding cores (dist.cpu_binding) cannot apply here: 2 processes need a CPU "
        f"each, but this job may use 1 CPU ({cpu}: the affinity it was started with). Fix: lower --nproc"
    )
    assert not (tmp_path / "cores").exists()  # refused before anything started
