"""FSDP2 on 2 real gloo processes (each test with a hard timeout): it trains like DDP and like one process, evaluates
uneven validation shards exactly without hanging, resumes bitwise from full and sharded checkpoints, across process
counts and across strategies. `python -m pytest tests/distributed/test_fsdp.py -q`."""

from __future__ import annotations

import json
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from ignite_mgpu import launch
from ignite_mgpu.checkpoint.files import list_checkpoints, read_checkpoint
from ignite_mgpu.checkpoint.tools import convert
from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.train.default_job import training
from tests.conftest import TINY, cpu_only, run_cli
from tests.helpers import cpu_fsdp

pytestmark = [pytest.mark.distributed, pytest.mark.slow, cpu_fsdp]
# 2000 training samples in global batches of 20: 100 steps an epoch. 101 validation samples, 10 per rank and batch:
# rank 0 holds 51 (6 batches), rank 1 50 (5 batches), so FSDP's evaluation must pad rank 1 with one forward.
JOB = ["model.name=mlp", "data.image_size=8", "data.train_size=2000", "data.val_size=101", "data.batch_size=20"]


def config(out: Path, *extra: str):
    return load_config(overrides=[*JOB, "train.epochs=2", f"output_dir={out}", "train.progress_bar=false", *extra])


def final_model(out: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(list_checkpoints(out)[0])["model"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_within(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert list(a) == list(b)
    for key in a:
        diff = (a[key] - b[key]).abs().max().item()
        assert diff <= atol, f"{key}: max difference {diff:.2e} > {atol:.0e}"


def launched_work(local_rank: int, root: str, fsdp2, ddp2) -> None:
    """The work of the tests that launch() from here, one part after the other in the same 2 processes (one
    start-up): the default job under FSDP and under DDP, the public API's accumulation runs, the fp16 scaler. Each
    part builds its own objects."""
    training(local_rank, fsdp2)
    training(local_rank, ddp2)
    accumulation_runs(local_rank, str(Path(root, "accumulation")))
    scaler_worker(local_rank, str(Path(root, "scaler")))


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """One 2-process launch() job, shared by the tests that read its parts: ``fsdp2`` and ``ddp2`` (the default
    job's runs), ``accumulation``, ``scaler``."""
    root = tmp_path_factory.mktemp("launched")
    for part in ("accumulation", "scaler"):
        (root / part).mkdir()
    with cpu_only(root / "claims"):
        fsdp2, ddp2 = config(root / "fsdp2", "dist.strategy=fsdp"), config(root / "ddp2")
        launch(launched_work, str(root), fsdp2, ddp2, nproc=2, backend="gloo")
    return root


@pytest.mark.timeout(300)
def test_fsdp_trains_like_ddp_and_like_one_process_and_evaluates_uneven_shards_exactly(tmp_path, launched):
    fsdp2, ddp2, fsdp1 = launched / "fsdp2", launched / "ddp2", tmp_path / "fsdp1"
    launch(training, config(fsdp1, "dist.strategy=fsdp"), nproc=1)
    sharded = final_model(fsdp2)
    assert list_checkpoints(fsdp2)[0].name == "checkpoint_200.pt"  # 200 steps, same seed and global batch, fp32
    assert_within(sharded, final_model(ddp2), atol=1e-5)
    assert_within(sharded, final_model(fsdp1), atol=1e-5)

    # The checkpoint is DDP's file: plain tensors, optimizer state keyed by parameter index; the best model a plain
    # state_dict that loads into the unwrapped model.
    ckpt = read_checkpoint(list_checkpoints(fsdp2)[0])
    assert list(ckpt["model"]) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert all(type(t) is torch.Tensor for t in ckpt["model"].values())
    assert sorted(ckpt["optimizer"]["state"]) == [0, 1, 2, 3] and ckpt["optimizer"]["param_groups"][0]["params"] == [
        0,
        1,
        2,
        3,
    ]
    from ignite_mgpu.train.data.datasets import build_datasets
    from ignite_mgpu.train.models import create_model

    cfg = config(fsdp2)
    model = create_model(cfg.model, torch.zeros(1, 3, 8, 8))
    (best,) = fsdp2.glob("best_model_*.pt")
    model.load_state_dict(read_checkpoint(best))

    # The last epoch's validation (2 ranks, 6 and 5 batches) equals one process scoring every sample once.
    model.load_state_dict(sharded)
    val = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed).val
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        logits = model(x)
    last = metrics(fsdp2)[-1]
    assert last["val_accuracy"] == pytest.approx((logits.argmax(1) == y).float().mean().item(), abs=1e-6)
    assert last["val_loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-5)
    assert len(last["peak_memory_mb"]) == 2
    # FSDP's all-gathers before each block's forward and backward are its communication (reduce-scatters: compute).
    assert min(last["time_comm_ms"]) > 0 and min(last["time_compute_ms"]) > 0

    # `ignite-mgpu evaluate` with FSDP on 2 processes scores the best model as one process does.
    args = [*JOB, "--checkpoint", str(best), "--json"]
    scores = [run_cli(["evaluate", *args, *extra], tmp_path) for extra in (["--strategy", "fsdp", "--nproc", "2"], [])]
    assert all(s.returncode == 0 for s in scores), scores[0].stderr[-3000:]
    two, one = (json.loads(s.stdout.strip().splitlines()[-1]) for s in scores)
    assert two["samples"] == one["samples"] == 101
    assert two["accuracy"] == pytest.approx(one["accuracy"], abs=1e-6)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)


def accumulation_worker(local_rank: int, out: str, strategy: str, global_batch: int, accum: int) -> None:
    """The public API with FSDP: gradient accumulation (sync off on accumulation steps) and global-norm clipping.
    Everything it builds is its own: a second call in the same processes starts afresh."""
    from torch.utils.data import TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from ignite_mgpu import create_trainer, prepare_model
    from ignite_mgpu.checkpoint.state import checkpoint_objects

    torch.manual_seed(0)
    x, y = torch.randn(128, 10), torch.randint(0, 3, (128,))
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, idist.get_world_size(), idist.get_rank(), shuffle=True, seed=1)
    loader = idist.auto_dataloader(ds, batch_size=global_batch, sampler=sampler)
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    model = prepare_model(net, strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # after sharding
    syncs: list[bool] = []
    if strategy == "fsdp":  # record what the trainer asks of FSDP around each backward
        original = model.set_requires_gradient_sync
        model.set_requires_gradient_sync = lambda flag, **kw: (syncs.append(flag), original(flag, **kw))[1]
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss(), grad_accum_steps=accum, clip_grad_norm=0.05)
    trainer.run(loader, max_epochs=3)
    state = checkpoint_objects(model, optimizer)[0].state_dict()  # gathered on rank 0 (FSDP) or the module's
    if idist.get_rank() == 0:
        torch.save({"state": state, "syncs": syncs}, Path(out) / f"{strategy}-{accum}.pt")


def accumulation_runs(local_rank: int, out: str) -> None:
    """DDP, FSDP, and FSDP with 2 accumulation steps, in turn."""
    for strategy, batch, accum in (("ddp", 32, 1), ("fsdp", 32, 1), ("fsdp", 16, 2)):
        accumulation_worker(local_rank, out, strategy, batch, accum)


@pytest.mark.timeout(300)
def test_fsdp_accumulation_skips_sync_and_clipping_takes_the_global_norm(launched):
    ddp, fsdp, accumulated = (
        torch.load(launched / "accumulation" / name, weights_only=True)
        for name in ("ddp-1.pt", "fsdp-1.pt", "fsdp-2.pt")
    )
    # clip_grad_norm=0.05 clips every step: a norm over each rank's own shard would give other updates than DDP.
    assert_within(fsdp["state"], ddp["state"], atol=1e-5)
    assert_within(accumulated["state"], ddp["state"], atol=1e-5)  # 2 micro-batches of 8 per rank == one of 16
    assert fsdp["syncs"] == [] and accumulated["syncs"] == [False, True] * 12  # 4 steps x 3 epochs, sync off first


def scaler_worker(local_rank: int, out: str) -> None:
    """fp16's loss scaling over sharded gradients with the trainer's GradScaler (its CPU variant: the same code as
    on CUDA): an overflow in one rank's shard must skip the step on every rank, or the shards would drift apart."""
    from ignite_mgpu import prepare_model
    from ignite_mgpu.train.step.trainer import Scaler

    torch.manual_seed(0)
    model = prepare_model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), "fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = Scaler("cpu", init_scale=1024.0)
    before = [p.full_tensor().clone() for p in model.parameters()]
    scaler.scale(nn.functional.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,)))).backward()
    if idist.get_rank() == 1:
        model[2].weight.grad.to_local().view(-1)[0] = float("inf")  # only rank 1's shard overflows
    scaler.step(optimizer)
    scaler.update()
    stepped = any(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters(), strict=True))
    Path(out, f"rank{idist.get_rank()}.json").write_text(json.dumps({"scale": scaler.get_scale(), "stepped": stepped}))


@pytest.mark.timeout(300)
def test_fp16_loss_scaling_skips_an_overflowing_step_on_every_rank(launched):
    ranks = [json.loads((launched / "scaler" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [{"scale": 512.0, "stepped": False}] * 2


def cli(args: list[str], cwd: Path) -> str:
    result = run_cli(["train", *args], cwd, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def model_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    if checkpoint.is_dir():
        convert(checkpoint, checkpoint.parent / f"{checkpoint.name}.model")
        return torch.load(checkpoint.parent / f"{checkpoint.name}.model", weights_only=True)
    return read_checkpoint(checkpoint)["model"]


@pytest.mark.timeout(600)
def test_resume_is_bitwise_for_both_formats_across_process_counts_and_strategies(tmp_path):
    """Deterministic 2-process runs saved every 4 iterations (16 in all; 12 is mid-epoch 2): resumed from
    checkpoint 12 they end bitwise equal, for full files and for sharded folders; a sharded folder written by 2
    processes resumes on 1; a full FSDP checkpoint resumes under DDP and a DDP one under FSDP."""
    args = [*TINY, "model.name=mlp", "data.image_size=8", "train.deterministic=true", "checkpoint.every_iters=4",
            "checkpoint.n_saved=10", "train.progress_bar=false"]  # fmt: skip
    fsdp, two = ["--strategy", "fsdp"], ["--nproc", "2"]
    runs = {}
    for fmt in ("full", "sharded"):
        out = runs[fmt] = tmp_path / fmt
        cli([*args, *fsdp, *two, f"checkpoint.format={fmt}", "--output-dir", str(out)], tmp_path)
        twelve = out / ("checkpoint_12.pt" if fmt == "full" else "checkpoint_12")
        resumed = tmp_path / f"{fmt}-resumed"
        err = cli([*args, *fsdp, *two, f"checkpoint.format={fmt}", "--output-dir", str(resumed), "--resume",
                   str(twelve)], tmp_path)  # fmt: skip
        assert "resumed from" in err
        name = "checkpoint_16.pt" if fmt == "full" else "checkpoint_16"
        a, b = model_of(out / name), model_of(resumed / name)
        for key in a:
            assert torch.equal(a[key], b[key]), (fmt, key)
    sharded = runs["sharded"]
    assert (sharded / "checkpoint_16" / ".metadata").is_file() and len(
        list((sharded / "checkpoint_16").glob("*.distcp"))
    ) == 2
    assert_within(model_of(sharded / "checkpoint_16"), model_of(runs["full"] / "checkpoint_16.pt"), atol=0)

    # A sharded folder written by 2 processes resumes on 1 (resharded as it is read) and continues.
    one = tmp_path / "sharded-on-1"
    err = cli([*args, *fsdp, "--nproc", "1", "checkpoint.format=sharded", "--output-dir", str(one), "--resume",
               str(sharded / "checkpoint_12"), "train.epochs=3"], tmp_path)  # fmt: skip
    assert "written with 2 processes, resuming with 1" in err and "nothing to shard" in err
    assert [r["epoch"] for r in metrics(one)] == [2, 3] and (one / "checkpoint_24" / ".metadata").is_file()

    # Across strategies, on the same data order: FSDP's full checkpoint 12 resumed under DDP (which writes sharded
    # folders itself), DDP's under FSDP, and FSDP's sharded folder under DDP.
    ddp = tmp_path / "ddp"
    cli([*args, *two, "--output-dir", str(ddp)], tmp_path)
    for source, strategy, target, fmt in (
        (runs["full"] / "checkpoint_12.pt", "ddp", "fsdp-to-ddp", "sharded"),
        (ddp / "checkpoint_12.pt", "fsdp", "ddp-to-fsdp", "full"),
        (sharded / "checkpoint_12", "ddp", "sharded-to-ddp", "full"),
    ):
        cli([*args, *two, "--strategy", strategy, f"checkpoint.format={fmt}", "--output-dir", str(tmp_path / target),
             "--resume", str(source)], tmp_path)  # fmt: skip
        written = tmp_path / target / ("checkpoint_16" if fmt == "sharded" else "checkpoint_16.pt")
        reference = source.parent / ("checkpoint_16" if source.is_dir() else "checkpoint_16.pt")
        assert_within(model_of(written), model_of(reference), 1e-5)

    # checkpoint inspect reads folders; convert writes the plain state_dict the full format holds.
    inspected = CliRunner().invoke(main, ["checkpoint", "inspect", str(one / "checkpoint_24"), "--json"])
    assert inspected.exit_code == 0, inspected.output
    info = json.loads(inspected.stdout)
    assert info["kind"] == "sharded checkpoint" and info["iteration"] == 24 and info["shard_files"] == 1
    assert info["first_keys"] == ["1.weight", "1.bias", "3.weight", "3.bias"] and info["run"]["world_size"] == 1
    converted = CliRunner().invoke(
        main, ["checkpoint", "convert", str(sharded / "checkpoint_16"), str(tmp_path / "m.pt")]
    )
    assert converted.exit_code == 0 and "wrote" in converted.output, converted.output
    assert_within(torch.load(tmp_path / "m.pt", weights_only=True), model_of(runs["full"] / "checkpoint_16.pt"), 0)
