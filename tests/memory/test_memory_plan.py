"""The memory plan (memory/estimate.py, budget.py, table.py, ``ignite-mgpu plan``): exact bytes of
a Linear stack, the fit arithmetic, the GPU capacity from a snapshot, the table, the JSON and the refusals; and the
estimate against a real step's measured peak on the CPU (benchmarks/memory/real_peak.py, one spawned process).
Run: python -m pytest -q tests/memory/test_memory_plan.py"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from click.testing import CliRunner
from torch import nn

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import inventory
from ignite_mgpu.gpus.inventory import GpuInfo
from ignite_mgpu.memory import budget
from ignite_mgpu.memory.budget import MIB, Capacity, capacity, largest_fit, make_memory_plan
from ignite_mgpu.memory.estimate import example_batch, measure
from ignite_mgpu.memory.table import format_plan, size, to_json
from tests.conftest import REPO

IN, HIDDEN, OUT = 3 * 8 * 8, 64, 10  # 8x8 synthetic images, flattened
PARAMS = (IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT) * 4  # fp32 bytes
STACK = [
    "model.name=tests.memory.test_memory_plan:linear_stack",
    "data.image_size=8",
    "data.train_size=64",
    "data.val_size=8",
    "data.batch_size=16",
]


def linear_stack(num_classes: int = OUT) -> nn.Module:
    """Two Linear layers in one Sequential: FSDP's default rule shards each Linear; every shard splits evenly."""
    return nn.Sequential(nn.Flatten(), nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, num_classes))


def lazy_stack(num_classes: int = OUT) -> nn.Module:
    """The same stack with lazy layers: their parameters take their shapes from the first batch."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(HIDDEN), nn.ReLU(), nn.LazyLinear(num_classes))


@pytest.fixture(scope="module")
def stack_cfg():
    return load_config(None, STACK)


def test_parameters_gradients_and_sgd_momentum_are_exact(stack_cfg):
    f = measure(stack_cfg, example_batch(stack_cfg), 16)
    assert (f.params, f.grads, f.optimizer, f.buckets) == (PARAMS, PARAMS, PARAMS, 0)  # one momentum buffer each
    assert f.inputs == 16 * IN * 4 + 16 * 8  # the images and the int64 labels
    assert f.outputs == 16 * OUT * 4
    assert f.peak >= f.params + f.grads + f.optimizer + f.inputs  # this small model peaks in the optimizer step


def test_adamw_state_ddp_buckets_and_fsdp_shards_are_exact(stack_cfg):
    cfg = load_config(None, [*STACK, "optim.name=adamw"])
    example = example_batch(cfg)
    one = measure(cfg, example, 8, 2, "ddp")
    assert one.optimizer == 2 * PARAMS + 4 * 4  # exp_avg, exp_avg_sq, and a float32 step per parameter
    assert one.buckets == PARAMS  # DDP keeps a bucket copy of every gradient
    sharded = measure(cfg, example, 8, 2, "fsdp")
    assert (sharded.params, sharded.grads) == (PARAMS // 2, PARAMS // 2)
    assert sharded.optimizer == PARAMS + 4 * 4
    assert sharded.block == (IN * HIDDEN + HIDDEN) * 4  # the larger Linear, gathered
    assert sharded.peak < one.peak


def test_largest_fit_keeps_the_margin():
    # fixed 100 + 10 per sample, 15 % margin: 230 bytes take 100 + 10 m <= 200, m = 10
    assert largest_fit(100, 10, 230, 64) == 10
    assert largest_fit(100, 10, 230, 4) == 4
    assert largest_fit(100, 10, 120, 64) is None
    assert largest_fit(100, 0, 230, 64) == 64


def gpu(index, used_mb, total_mb=10240):
    return GpuInfo(index, f"00000000:0{index}:00.0", "NVIDIA A100", used_mb, total_mb, 0, 0)


def test_capacity_reads_the_selected_gpus_free_memory(monkeypatch):
    monkeypatch.setattr(budget, "_available_ram", lambda: 10 * 2**30)
    monkeypatch.setattr(budget, "_resident_bytes", lambda: 2**30)
    cfg = load_config(None, ["dist.gpus=1,2"])
    cap = capacity(cfg, {}, [gpu(0, 0), gpu(1, 2048), gpu(2, 9216)])
    assert cap.device == "cuda" and cap.where == "GPU 1,2"
    assert cap.host_ram == 8 * 2**30  # the available RAM less each process's own (as this one holds)
    assert cap.free == [8192 * MIB - budget.CUDA_CONTEXT, 1024 * MIB - budget.CUDA_CONTEXT]
    assert capacity(load_config(None, ["dist.gpus=auto:1"]), {}, [gpu(0, 5000), gpu(1, 10)]).where == "GPU 1"
    cpu = capacity(load_config(None, ["dist.nproc=2"]), {}, [])
    assert cpu.device == "cpu" and len(cpu.free) == 2 and cpu.reserve > 0
    # Issue #44 (4): --nproc 2 on more GPUs plans the 2 GPUs the job uses (the batch over 2, not over all).
    two = capacity(load_config(None, ["dist.nproc=2"]), {}, [gpu(0, 0), gpu(1, 2048), gpu(2, 0), gpu(3, 0)])
    assert two.where == "GPU 0,1" and two.free == [10240 * MIB - budget.CUDA_CONTEXT, 8192 * MIB - budget.CUDA_CONTEXT]


def test_plan_with_nproc_on_the_four_gpu_stand_in_splits_the_batch_over_nproc(monkeypatch):
    monkeypatch.setenv("PATH", f"{REPO / 'tests' / 'fake_gpus'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(inventory, "_run_nvidia_smi", lambda argv: subprocess.run(
        [str(REPO / "tests" / "fake_gpus" / "nvidia-smi"), *argv[1:]], capture_output=True, text=True, check=True
    ).stdout)  # fmt: skip
    result = CliRunner().invoke(main, ["plan", *STACK, "--nproc", "2"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "global batch 16 over 2 processes (8 each)" in result.output and "GPU 0,1" in result.output


def test_a_tight_gpu_gets_a_micro_batch_and_dp_its_gpu0_share(stack_cfg):
    full = make_memory_plan(stack_cfg, Capacity("cuda", [2**30, 2**30], "GPU 0,1", 0))
    rows = {r.strategy: r for r in full.rows}
    assert rows["ddp"].fits and rows["ddp"].batch == 8 and full.advice.startswith("fits: --strategy ddp")
    assert rows["dp"].batch == 16 and rows["dp"].extra > 0 and rows["dp"].note == "GPU 0 of 2"
    ddp = rows["ddp"]
    fixed = ddp.peak - ddp.activations_per_sample * ddp.batch
    room_for_4 = int((fixed + 4.5 * ddp.activations_per_sample) * 1.15)  # ddp: 4 of its 8 samples; fsdp: all
    tight = make_memory_plan(stack_cfg, Capacity("cuda", [room_for_4] * 2, "GPU 0,1", 0))
    best = {r.strategy: r for r in tight.rows}
    assert (best["ddp"].fits, best["ddp"].micro_batch) == (False, 4)
    assert best["fsdp"].fits and tight.advice.startswith("fits: --strategy fsdp with the whole batch")
    alone = make_memory_plan(stack_cfg, Capacity("cuda", [2**30], "GPU 0", 0)).rows[0]  # 16 samples, no buckets
    room_for_8 = int((alone.peak - alone.activations_per_sample * 7.5) * 1.15)
    one = make_memory_plan(stack_cfg, Capacity("cuda", [room_for_8], "GPU 0", 0))
    assert one.advice.startswith("the whole batch does not fit; --strategy ddp with train.micro_batch=8 does")
    none = make_memory_plan(stack_cfg, Capacity("cuda", [1000, 1000], "GPU 0,1", 0))
    assert none.advice.startswith("nothing fits in GPU 0,1")
    text = format_plan(tight)
    assert "micro-batch" in text and "GPU 0,1" in text and "largest gathered block 48.2 KiB" in text


def test_on_the_cpu_the_background_checkpoints_snapshot_is_counted(stack_cfg):
    """checkpoint.async_save (the default) keeps a copy of the saved state in RAM: on the CPU, where training uses
    the same RAM, the fit counts it (the whole state for format=full, each process's shards for sharded); on GPUs
    it is host memory, not the GPU's."""
    cfg = load_config(None, [*STACK, "optim.name=adamw"])
    state = PARAMS + 2 * PARAMS + 4 * 4  # the parameters and AdamW's state of the whole model
    cpu = {r.strategy: r for r in make_memory_plan(cfg, Capacity("cpu", [2**30, 2**30], "the CPU (RAM)", 0)).rows}
    assert (cpu["ddp"].snapshot, cpu["fsdp"].snapshot) == (state, state)
    sharded = load_config(None, [*STACK, "optim.name=adamw", "checkpoint.format=sharded"])
    rows = {r.strategy: r for r in make_memory_plan(sharded, Capacity("cpu", [2**30] * 2, "the CPU", 0)).rows}
    assert rows["fsdp"].snapshot == PARAMS // 2 + PARAMS + 4 * 4  # its own shards
    off = load_config(None, [*STACK, "optim.name=adamw", "checkpoint.async_save=false"])
    assert all(r.snapshot == 0 for r in make_memory_plan(off, Capacity("cpu", [2**30] * 2, "the CPU", 0)).rows)
    assert all(r.snapshot == 0 for r in make_memory_plan(cfg, Capacity("cuda", [2**30] * 2, "GPU 0,1", 0)).rows)
    ddp = cpu["ddp"]
    fixed = ddp.peak - ddp.activations_per_sample * ddp.batch
    room = int((fixed + ddp.activations_per_sample * ddp.batch) * 1.16)  # the step fits, the snapshot does not
    tight = {r.strategy: r for r in make_memory_plan(cfg, Capacity("cpu", [room] * 2, "the CPU", 0)).rows}
    assert not tight["ddp"].fits and tight["ddp"].snapshot == state
    shown = format_plan(make_memory_plan(cfg, Capacity("cpu", [room] * 2, "the CPU", 100 * MIB)))
    assert "the background checkpoint's snapshot stays in RAM (ddp: " in shown
    # What a process holds in all, as `top` shows it: PyTorch itself beside the step's tensors.
    whole = f"ddp: each process holds about {size(100 * MIB + ddp.peak)} in all: PyTorch itself (100.0 MiB) and"
    assert whole in shown and "a fit keeps 15 % of the peak free (the C library's heap" in shown  # its margin


def test_on_gpus_the_snapshot_is_checked_against_the_host_ram(stack_cfg):
    """On GPUs the background checkpoint's snapshot is pinned host RAM (rank 0's whole state for format=full, the
    processes' shards for sharded: the whole state either way): the plan says how much, and its advice says when the
    RAM available now cannot hold it (with the margin), naming the fix."""
    cfg = load_config(None, [*STACK, "optim.name=adamw"])
    state = PARAMS + 2 * PARAMS + 4 * 4
    roomy = make_memory_plan(cfg, Capacity("cuda", [2**30] * 2, "GPU 0,1", 0, host_ram=2**30))
    assert roomy.host_snapshot == state and roomy.advice.startswith("fits: --strategy ddp")
    assert "But" not in roomy.advice
    note = f"snapshot takes {size(state)} of pinned host RAM (of 1.00 GiB available beside the processes), not GPU"
    assert note in format_plan(roomy)
    tight = make_memory_plan(cfg, Capacity("cuda", [2**30] * 2, "GPU 0,1", 0, host_ram=int(state * 1.1)))
    assert tight.advice.startswith("fits: --strategy ddp with the whole batch")
    assert tight.advice.endswith(
        f"But the background checkpoint's snapshot, {size(state)} of pinned host RAM from the first save on, does "
        f"not fit in the {size(int(state * 1.1))} this machine has available beside the job's processes: set "
        "checkpoint.async_save=false (the step writes the checkpoint itself), or free RAM."
    ), tight.advice
    assert json.loads(to_json(tight))["host_snapshot"] == state
    sharded = load_config(None, [*STACK, "optim.name=adamw", "checkpoint.format=sharded"])
    assert make_memory_plan(sharded, Capacity("cuda", [2**30] * 2, "GPU 0,1", 0, host_ram=2**30)).host_snapshot == state
    two_nodes = load_config(
        None, [*STACK, "optim.name=adamw", "checkpoint.format=sharded", "dist.nnodes=2", "dist.master_port=29500"]
    )
    on_each = make_memory_plan(two_nodes, Capacity("cuda", [2**30] * 2, "GPU 0,1", 0, host_ram=2**30))
    assert on_each.host_snapshot == -(-state // 2)  # each machine snapshots its own processes' shards
    off = load_config(None, [*STACK, "optim.name=adamw", "checkpoint.async_save=false"])
    quiet = make_memory_plan(off, Capacity("cuda", [2**30] * 2, "GPU 0,1", 0, host_ram=16))
    assert quiet.host_snapshot == 0 and "But" not in quiet.advice and "pinned" not in format_plan(quiet)
    cpu = make_memory_plan(cfg, Capacity("cpu", [2**30] * 2, "the CPU", 0, host_ram=16))
    assert cpu.host_snapshot == 0 and "But" not in cpu.advice  # on the CPU the fit counts it (above)


def test_size_reads_as_people_read_it():
    assert [size(812), size(40872), size(3 * 2**20), size(1.5 * 2**30)] == ["812 B", "39.9 KiB", "3.0 MiB", "1.50 GiB"]


def test_the_command_prints_the_table_and_json():
    result = CliRunner().invoke(main, ["plan", *STACK, "--nproc", "2"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("memory plan: model tests.memory.test_memory_plan:linear_stack, optimizer sgd")
    assert "global batch 16 over 2 processes (8 each)" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["ddp"], ["fsdp"], ["dp"])}
    assert rows["ddp"][1:3] == ["2", "8"] and rows["ddp"][3:5] == ["50.8", "KiB"]  # 13002 parameters, fp32
    assert rows["dp"][-1] == "(nn.DataParallel)"  # no GPU here
    assert any(line.startswith("fits: --strategy ddp") for line in lines)
    out = CliRunner().invoke(main, ["plan", *STACK, "--json"], catch_exceptions=False)
    plan = json.loads(out.output)
    assert plan["processes"] == 1 and plan["capacity"]["device"] == "cpu"
    assert [r["strategy"] for r in plan["rows"]] == ["ddp", "fsdp", "dp"]
    assert plan["rows"][0]["params"] == PARAMS and plan["rows"][0]["micro_batch"] == 16


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model.name=no_such_model"], "model.name=no_such_model is not a known model"),
        ([*STACK, "data.batch_size=1", "--nproc", "2"], "data.batch_size=1 is the global batch, split over 2"),
        (["optim.name=Nope"], "optim.name=Nope"),
    ],
)
def test_bad_input_is_one_paragraph_and_exit_2(args, message):
    result = CliRunner().invoke(main, ["plan", *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_plan_refuses_inside_a_process_group(stack_cfg, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="needs its own process group"):
        measure(stack_cfg, example_batch(stack_cfg), 8, 2, "fsdp")


@pytest.mark.timeout(60)
def test_the_fake_group_passes_an_init_barrier_alone(stack_cfg, monkeypatch):
    """TORCH_DIST_INIT_BARRIER=1 makes init_process_group wait on its store for every rank: the plan's store,
    whose other ranks do not exist, lets it pass at once (a HashStore would wait for the group's timeout)."""
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    assert measure(stack_cfg, example_batch(stack_cfg), 8, 2, "fsdp").params == PARAMS // 2


def test_a_pytorch_without_the_fake_backend_is_one_paragraph(stack_cfg, monkeypatch):
    import torch.distributed as dist

    def unknown(*args, **kwargs):
        raise AssertionError("Unknown c10d backend type FAKE")  # PyTorch 2.14's words when it is not registered

    monkeypatch.setattr(dist, "init_process_group", unknown)
    with pytest.raises(ConfigError, match=r'"fake" process-group backend.*Unknown c10d backend.*--nproc 1'):
        measure(stack_cfg, example_batch(stack_cfg), 8, 2, "fsdp")
    assert not dist.is_initialized()


def test_the_tensors_of_a_batch_at_any_depth():
    import torch

    from ignite_mgpu.train.data.batches import tensors

    a, b, c = torch.zeros(1), torch.ones(2), torch.ones(3)
    assert tensors({"x": [a, (b, "text")], "y": {"z": c}, "n": 3}) == [a, b, c]
    assert tensors(a) == [a] and tensors("text") == []


def test_unknown_fsdp_block_is_a_config_error(stack_cfg):
    cfg = load_config(None, [*STACK, "model.fsdp_blocks=[Nope]", "dist.strategy=fsdp"])
    with pytest.raises(ConfigError, match="model.fsdp_blocks names Nope"):
        measure(cfg, example_batch(cfg), 8, 2, "fsdp")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_estimate_is_within_15_percent_of_a_measured_cpu_step():
    """The default CNN under ddp on one process, batch 256: the peak a real step adds to a fresh process's resident
    high-water mark (glibc giving freed blocks back), against the fake-tensor estimate."""
    from benchmarks.memory import real_peak

    cfg = load_config(None, ["data.train_size=256"])
    estimate = measure(cfg, example_batch(cfg), 256).peak
    (measured,) = real_peak.measure(cfg, "ddp", 1, 256)
    assert abs(estimate - measured) <= 0.15 * measured, (estimate, measured)


def test_on_cuda_the_optimizer_runs_its_foreach_path_and_cublas_has_its_workspaces(monkeypatch):
    # Issue #44 (10): fake CPU tensors take torch.optim's single-tensor path; CUDA takes foreach, whose AdamW holds
    # a temporary of every parameter at once (the single-tensor path: two of the largest). cuBLAS's workspaces are
    # counted by CUDA's allocator too.
    import torch.optim.adam as adam

    from ignite_mgpu.memory.estimate import CUBLAS_WORKSPACES

    ran = []
    for path in ("_single_tensor_adam", "_multi_tensor_adam"):
        real = getattr(adam, path)
        monkeypatch.setattr(adam, path, lambda *a, _real=real, _path=path, **k: ran.append(_path) or _real(*a, **k))
    cfg = load_config(None, [*STACK, "optim.name=adamw"])
    example = example_batch(cfg)
    cpu = measure(cfg, example, 8)
    assert set(ran) == {"_single_tensor_adam"}
    ran.clear()
    cuda = measure(cfg, example, 8, cuda=True)
    assert set(ran) == {"_multi_tensor_adam"}
    assert (cpu.workspaces, cuda.workspaces) == (0, CUBLAS_WORKSPACES) and cuda.peak != cpu.peak + CUBLAS_WORKSPACES
    assert (cuda.params, cuda.optimizer) == (cpu.params, cpu.optimizer)


@pytest.mark.parametrize("strategy, world_size", [("ddp", 1), ("fsdp", 2)])
def test_a_model_with_lazy_layers_is_measured_like_its_plain_twin(stack_cfg, strategy, world_size):
    """Lazy layers cannot make parameters under the fake mode: the model is materialised on the meta device, then
    given fake storage; its footprint is the plain stack's (under FSDP the peak's activations are measured 19 %
    lower here than the plain twin's, for a reason not found: bounded at 25 %)."""
    lazy_cfg = load_config(None, [*STACK, "model.name=tests.memory.test_memory_plan:lazy_stack"])
    example = example_batch(stack_cfg)
    plain, lazy = (measure(c, example, 16, world_size, strategy) for c in (stack_cfg, lazy_cfg))
    assert lazy.params == plain.params == PARAMS // world_size
    assert (lazy.grads, lazy.optimizer, lazy.inputs) == (plain.grads, plain.optimizer, plain.inputs)
    if strategy == "ddp":
        assert lazy.peak == plain.peak
    else:
        assert 0.75 * plain.peak <= lazy.peak <= plain.peak


def test_gpu_ids_on_a_machine_without_gpus_are_refused_as_train_refuses_them(monkeypatch):
    monkeypatch.setattr(budget, "query_gpus", list)  # nvidia-smi finds none
    result = CliRunner().invoke(main, ["plan", *STACK, "--gpus", "2,3"])
    assert result.exit_code == 2, result.output
    assert "--gpus 2,3 requested but no NVIDIA GPU is visible" in result.output
    assert CliRunner().invoke(main, ["plan", *STACK, "--gpus", "none"]).exit_code == 0  # the CPU, as asked


def test_nothing_fits_prints_the_table_and_exits_with_its_own_code(monkeypatch):
    from ignite_mgpu.errors import EXIT_CODES, NOTHING_FITS

    monkeypatch.setattr(budget, "query_gpus", list)
    monkeypatch.setattr(budget, "_available_ram", lambda: 1 << 20)  # 1 MiB of RAM: not even the runtime fits
    result = CliRunner().invoke(main, ["plan", *STACK])
    assert result.exit_code == NOTHING_FITS == 5 and "plan: nothing fits" in EXIT_CODES[5]
    assert "nothing fits in the CPU (RAM)" in result.output and "strategy" in result.output  # the table too
