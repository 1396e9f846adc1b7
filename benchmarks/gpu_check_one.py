"""The one-GPU check (#44): what a single lent GPU can show of the CUDA paths, each check in a fresh process (its own
CUDA context and process group, a hard timeout), one line each: PASS / FAIL / SKIP, the check's name, what it saw.

    python benchmarks/gpu_check_one.py            # every check (under 10 minutes; bash benchmarks/gpu_check.sh one)
    python benchmarks/gpu_check_one.py --list     # what each check covers
    python benchmarks/gpu_check_one.py --cpu      # a dry run on the CPU (gloo): the checks that can, to test this file

A one-process group over NCCL is what one GPU allows: it runs NCCL's code paths (DDP's reducer, FSDP2's collectives,
torch.distributed.checkpoint), not a transfer between GPUs; the 2-GPU tests (tests/gpu, `-m gpu`) do that."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 150  # seconds per check (the CLI runs' check: 250)
TINY = ["data.train_size=256", "data.val_size=101", "data.image_size=16", "data.batch_size=32", "train.epochs=2"]


def device(cpu: bool):
    import torch

    return torch.device("cpu") if cpu else torch.device("cuda", 0)


def one_process_group(folder: Path, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    if not cpu:
        torch.cuda.set_device(0)
    store = dist.FileStore(str(folder / "store"), 1)
    dist.init_process_group("gloo" if cpu else "nccl", store=store, rank=0, world_size=1)


def small(dev):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)


def data(n: int = 8, batch: int = 16, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def check_nccl_ddp(folder: Path, cpu: bool) -> str:
    """NCCL with a one-process group: DDP's wrap, a step through its reducer, an all-reduce."""
    import torch
    import torch.distributed as dist
    from torch import nn

    one_process_group(folder, cpu)
    dev = device(cpu)
    model = nn.parallel.DistributedDataParallel(small(dev), device_ids=None if cpu else [0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (t.to(dev) for t in data(1)[0])
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    t = torch.ones(3, device=dev)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    return f"DDP step and all_reduce over {dist.get_backend()}"


def check_fsdp_offload(folder: Path, cpu: bool) -> str:
    """FSDP2 on one rank with CPU offload, clipping and fp16's GradScaler: the mesh's group has a CPU backend
    (#44, 9)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from ignite_mgpu.parallel.fsdp import offload_mesh
    from ignite_mgpu.train.step.trainer import create_trainer

    one_process_group(folder, cpu)
    model = small(device(cpu))
    mesh = offload_mesh()
    policy = {} if cpu else {"offload_policy": CPUOffloadPolicy()}
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    precision = "bf16" if cpu else "fp16"
    trainer = create_trainer(
        model, opt, nn.CrossEntropyLoss(), device=device(cpu), precision=precision, clip_grad_norm=1.0
    )
    trainer.run(data(4), max_epochs=1)
    where = next(model.parameters()).to_local().device
    backend = dist.get_backend(mesh.get_group() if mesh is not None else None)
    return f"4 {precision} steps, clipped, parameters on {where}, mesh group {backend}"


def check_dcp_sharded(folder: Path, cpu: bool) -> str:
    """torch.distributed.checkpoint: FSDP2 shards saved (sync, then async with the pinned stager) and loaded."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.fsdp import fully_shard

    from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint, load_sharded

    one_process_group(folder, cpu)

    def objects(seed: int):
        model = small(device(cpu))
        torch.manual_seed(seed)
        for p in model.parameters():
            p.data.normal_()
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = (t.to(device(cpu)) for t in data(1)[0])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return model, opt

    model, opt = objects(1)
    for async_save in (False, True):
        handler = ShardedCheckpoint({"model": model, "optimizer": opt}, folder, 1, async_save)
        handler(SimpleNamespace(state=SimpleNamespace(iteration=1 + async_save)))
        handler.finish()
        fresh, fresh_opt = objects(2)
        load_sharded(folder / f"checkpoint_{1 + async_save}", {"model": fresh, "optimizer": fresh_opt})
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a.full_tensor(), b.full_tensor())
    return "saved sync and async (pinned stager), loaded equal"


def check_deterministic_resume(folder: Path, cpu: bool) -> str:
    """train.deterministic with AdamW: a run resumed from its checkpoint ends bitwise equal to one uninterrupted;
    after the load AdamW's step is a CPU tensor and numpy's RNG key restored (#44, 1 and 2)."""
    import torch
    from ignite.handlers import Checkpoint
    from torch import nn

    from ignite_mgpu.checkpoint.disk import SafeDiskSaver
    from ignite_mgpu.checkpoint.load import load_checkpoint
    from ignite_mgpu.train.step.trainer import create_trainer

    def objects():
        model = small(device(cpu))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), device=device(cpu), deterministic=True)
        return {"model": model, "optimizer": opt, "trainer": trainer}

    whole = objects()
    whole["trainer"].run(data(), max_epochs=2)
    first = objects()
    first["trainer"].run(data(), max_epochs=1)
    Checkpoint(first, SafeDiskSaver(folder), global_step_transform=lambda e, _: e.state.iteration)(first["trainer"])
    resumed = objects()
    load_checkpoint(folder / "checkpoint_8.pt", resumed)
    steps = {s["step"].device.type for s in resumed["optimizer"].state.values()}
    assert steps == {"cpu"}, steps
    resumed["trainer"].run(data(), max_epochs=2)
    for a, b in zip(whole["model"].parameters(), resumed["model"].parameters(), strict=True):
        assert torch.equal(a, b), "the resumed run differs"
    return "bitwise equal after resume; AdamW's step on the CPU"


def check_no_sync_per_step(folder: Path, cpu: bool) -> str:
    """No host-device sync in the step after a resume: AdamW's loaded state, micro-batches counting a mapping
    batch's labels (#44, 2 and 6); torch.cuda.set_sync_debug_mode("error") around each step raises at any sync
    (the guard's check, once a second and at the epoch's end, is outside the step)."""
    import torch
    from ignite.handlers import Checkpoint
    from torch import nn

    from ignite_mgpu.checkpoint.disk import SafeDiskSaver
    from ignite_mgpu.checkpoint.load import load_checkpoint
    from ignite_mgpu.train.step.trainer import create_trainer

    if cpu:
        return "SKIP: CUDA only"

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 8)

        def forward(self, input_ids, labels, num_items_in_batch=None):
            logits = self.emb(input_ids).flatten(0, 1)
            return {"loss": nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum") / num_items_in_batch}

    def objects():
        torch.manual_seed(0)
        model = LM().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return {"model": model, "optimizer": opt, "trainer": create_trainer(model, opt, None, micro_batch=2)}

    g = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": torch.randint(0, 8, (4, 5), generator=g).pin_memory(),
         "labels": torch.randint(-1, 8, (4, 5), generator=g).where(lambda t: t >= 0, -100).pin_memory()}
        for _ in range(4)
    ]  # fmt: skip
    first = objects()
    first["trainer"].run(batches, max_epochs=1)
    Checkpoint(first, SafeDiskSaver(folder), global_step_transform=lambda e, _: e.state.iteration)(first["trainer"])
    resumed = objects()
    load_checkpoint(folder / "checkpoint_4.pt", resumed)
    torch.cuda.synchronize()
    step = resumed["trainer"]._process_function

    def strict(engine, batch):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(engine, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    resumed["trainer"]._process_function = strict
    resumed["trainer"].run(batches, max_epochs=2)
    return "4 steps after a resume, micro-batched, without a sync"


def check_micro_batch_oom(folder: Path, cpu: bool) -> str:
    """micro_batch=auto on a real CUDA out-of-memory error, in one process, with fp16's GradScaler."""
    if cpu:
        return "SKIP: CUDA only"
    sys.path.insert(0, str(REPO))
    from tests.gpu.test_micro_batch import train

    model, trainer = train("auto", fits=5)
    assert model.seen[:3] == [16, 8, 4] and trainer.step.micro_batching.size == 4, (model.seen[:4],)
    return "16 and 8 ran out of memory, 4 fits and is kept"


def check_memory_plan(folder: Path, cpu: bool) -> str:
    """The memory plan's peak against torch.cuda.max_memory_allocated: the CNN and an MLP with AdamW (#44, 10)."""
    if cpu:
        return "SKIP: CUDA only"
    sys.path.insert(0, str(REPO))
    import torch

    from tests.gpu import test_memory_plan_cuda

    seen = []
    for overrides in (["data.train_size=512"], ["model.name=mlp", "optim.name=adamw"]):
        torch.cuda.empty_cache()
        try:
            test_memory_plan_cuda.test_estimate_is_within_15_percent_of_max_memory_allocated(overrides)
            seen.append(f"{overrides[-1]}: within 15 %")
        except AssertionError as err:
            seen.append(f"{overrides[-1]}: estimate, measured = {err}")
    assert all("within" in s for s in seen), "; ".join(seen)
    return "; ".join(seen)


def check_cpu_load_of_files(folder: Path, cpu: bool) -> str:
    """Every file a GPU run writes (checkpoints sync and async, best model .pt and .safetensors, a sharded folder's
    train_state.pt) loads with plain torch.load on a process without CUDA, every tensor on the CPU (#44, 3)."""
    gpus = ["--gpus", "none"] if cpu else ["--gpus", "0"]
    runs = {
        "sync": [],
        "async": ["checkpoint.async_save=true", "checkpoint.best_format=safetensors"],
        "sharded": ["checkpoint.format=sharded"],
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name, extra in runs.items():
        out = subprocess.run(
            [sys.executable, "-m", "ignite_mgpu", "train", *gpus, *TINY, "--output-dir", str(folder / name), *extra],
            capture_output=True, text=True, timeout=100, env=env,
        )  # fmt: skip
        assert out.returncode == 0, f"{name}: {out.stderr[-500:]}"
    probe = (
        "import sys, torch; from pathlib import Path; from safetensors.torch import load_file\n"
        "files = [p for p in Path(sys.argv[1]).rglob('*') if p.suffix in ('.pt', '.safetensors')]\n"
        "for p in files:\n"
        "    s = load_file(p) if p.suffix == '.safetensors' else torch.load(p, weights_only=True)\n"
        "    ts = [t for t in torch.utils._pytree.tree_leaves(s) if isinstance(t, torch.Tensor)]\n"
        "    assert all(t.device.type == 'cpu' for t in ts), p\n"
        "print(len(files))"
    )
    cpu_only = {**env, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True, env=cpu_only)
    assert out.returncode == 0, out.stderr[-500:]
    return f"{out.stdout.strip()} files loaded without CUDA, every tensor on the CPU"


def check_sticky_cuda_error(folder: Path, cpu: bool) -> str:
    """A sticky CUDA error in a rank (a device-side assert in its 2nd step, #50): the job ends with exit 1 within
    the check's time, naming rank 0 and the CUDA error once, no traceback storm and no hang. (Under NCCL it takes
    two GPUs: one GPU holds one NCCL rank.)"""
    if cpu:
        return "SKIP: CUDA only"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests' / 'faults'}{os.pathsep}{REPO}", "FAULT": "devassert:0:2"}
    env["PIDS_DIR"] = str(folder)
    cmd = [sys.executable, "-m", "ignite_mgpu", "train", "--gpus", "0", *TINY, "data.image_size=32"]  # faultmod's
    cmd += ["model.name=faultmod:make"]
    cmd += ["--output-dir", str(folder / "run")]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, f"exit {out.returncode}: {out.stderr[-400:]}"
    assert "device-side assert" in out.stderr, out.stderr[-600:]
    said = [line for line in out.stderr.splitlines() if "rank 0" in line] or ["(no line names rank 0)"]
    return f"exit 1 in {time.monotonic() - start:.0f} s: {said[0][:120]}"


def check_lost_gpu_nvml(folder: Path, cpu: bool) -> str:
    """NVML's real error for a GPU that fell off the bus (NVML_ERROR_GPU_IS_LOST, raised for device 0 by a patched
    nvmlDeviceGetHandleByIndex of the real pynvml) leaves that device out of the snapshot without failing it (#50;
    with one GPU nothing else is left to show)."""
    if cpu:
        return "SKIP: CUDA only (NVML)"
    import pynvml

    from ignite_mgpu.gpus import inventory

    before = inventory.query_gpus()
    real = pynvml.nvmlDeviceGetHandleByIndex

    def handle(index: int):
        if index == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return real(index)

    pynvml.nvmlDeviceGetHandleByIndex = handle
    try:
        after = inventory.query_gpus()
    finally:
        pynvml.nvmlDeviceGetHandleByIndex = real
    assert before and before[0].index == 0 and 0 not in [g.index for g in after], (before, after)
    lost = type(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)).__name__
    return f"{len(before)} GPU(s) before, {len(after)} with GPU 0 lost ({lost})"


CHECKS: dict[str, Callable[[Path, bool], str]] = {
    "nccl_ddp": check_nccl_ddp,
    "fsdp_offload": check_fsdp_offload,
    "dcp_sharded": check_dcp_sharded,
    "deterministic_resume": check_deterministic_resume,
    "no_sync_per_step": check_no_sync_per_step,
    "micro_batch_oom": check_micro_batch_oom,
    "memory_plan": check_memory_plan,
    "cpu_load_of_files": check_cpu_load_of_files,
    "sticky_cuda_error": check_sticky_cuda_error,
    "lost_gpu_nvml": check_lost_gpu_nvml,
}


def run_one(name: str, cpu: bool) -> None:
    """In the child: run the check, print its line's detail last."""
    with tempfile.TemporaryDirectory() as tmp:
        print(CHECKS[name](Path(tmp), cpu), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="what each check covers")
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU (gloo)")
    parser.add_argument("--only", nargs="*", default=list(CHECKS), choices=list(CHECKS))
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        for name, check in CHECKS.items():
            print(f"{name}: {' '.join((check.__doc__ or '').split())}")
        return 0
    if args.run:
        run_one(args.run, args.cpu)
        return 0
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}  # this checkout's package

    def check(name: str) -> str:
        start = time.monotonic()
        cmd = [sys.executable, __file__, "--run", name, *(["--cpu"] if args.cpu else [])]
        try:
            limit = 250 if name == "cpu_load_of_files" else TIMEOUT
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=REPO, env=env)
            lines = (out.stdout.strip() or "no output").splitlines()
            detail = lines[-1] if out.returncode == 0 else (out.stderr.strip().splitlines() or ["no error"])[-1]
            verdict = "SKIP" if detail.startswith("SKIP") else "PASS" if out.returncode == 0 else "FAIL"
        except subprocess.TimeoutExpired:
            verdict, detail = "FAIL", f"did not finish in {limit} s"
        return f"{verdict} {name} ({time.monotonic() - start:.0f} s): {detail.removeprefix('SKIP: ')}"

    # On the GPU one check at a time, each alone on the device; the CPU dry run only tests this file: two at a time.
    failed = 0
    with ThreadPoolExecutor(2 if args.cpu else 1) as pool:
        for line in pool.map(check, args.only):  # in the order asked, each line once its check is done
            failed += line.startswith("FAIL")
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
