"""The launch plan, decided in the parent without spawning anything.
`python -m pytest tests/processes/test_plan.py`."""

import os

import pytest

from ignite_mgpu.config.loading import load_config
from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.processes.plan import make_plan


def test_cpu_defaults(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    plan = make_plan(DistConfig())[0]
    assert (plan.nproc, plan.backend, plan.world_size, plan.external) == (1, None, 1, False)
    two = make_plan(DistConfig(nproc=2))[0]
    assert two.backend == "gloo" and two.env.get("OMP_NUM_THREADS") == "4"  # 8 cores split over 2 processes
    assert two.env.get("GLOO_SOCKET_IFNAME") == "lo"  # a single-node job listens on loopback only
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in make_plan(DistConfig(nproc=2))[0].env  # the user's choice is kept


def test_under_torchrun_the_outer_launcher_decides(monkeypatch):
    for key, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    plan = make_plan(DistConfig())[0]
    assert plan.external and plan.nproc == 2 and plan.world_size == 4
    with pytest.raises(ConfigError, match="drop --nproc"):
        make_plan(DistConfig(nproc=2))[0]
    with pytest.raises(ConfigError, match="not --gpus auto"):
        make_plan(DistConfig(gpus="auto:2"))[0]


def test_busy_master_port_is_named():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--master-port {port} is already in use"):
            make_plan(DistConfig(nproc=2, master_port=port))[0]


def test_checkpoints_must_fall_on_optimizer_steps():
    with pytest.raises(ConfigError, match=r"checkpoint.every_iters.*multiple of train.grad_accum_steps=4"):
        load_config(overrides=["train.grad_accum_steps=4", "checkpoint.every_iters=6"])
    assert load_config(overrides=["train.grad_accum_steps=4", "checkpoint.every_iters=8"]).checkpoint.every_iters == 8


@pytest.fixture
def cuda(monkeypatch):
    """Make this process's torch report ``n`` GPUs (the suite hides CUDA; the plan only asks torch.cuda)."""
    import torch

    def visible(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return visible


@pytest.fixture
def torchrun(monkeypatch):
    def started(local_world, world):
        for key, value in {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": world,
            "LOCAL_WORLD_SIZE": local_world,
        }.items():
            monkeypatch.setenv(key, str(value))

    return started


def test_under_torchrun_each_process_needs_every_gpu_of_the_node(cuda, torchrun):
    torchrun(local_world=4, world=8)
    cuda(1)  # e.g. SLURM --gpus-per-task=1: every process sees only its own GPU, ignite wants cuda:LOCAL_RANK
    with pytest.raises(ConfigError, match=r"4 processes on this node .* sees 1 GPU\(s\).*--gpus-per-node"):
        make_plan(DistConfig())[0]
    cuda(4)
    plan = make_plan(DistConfig())[0]
    assert plan.external and plan.backend == "nccl" and plan.device == "cuda" and plan.world_size == 8


def test_dataparallel_under_torchrun_with_several_processes_is_refused(cuda, torchrun):
    cuda(2)
    torchrun(local_world=2, world=2)
    with pytest.raises(ConfigError, match=r"--strategy dp under torchrun/SLURM with 2 processes"):
        make_plan(DistConfig(strategy="dp"))[0]
    torchrun(local_world=1, world=1)
    assert make_plan(DistConfig(strategy="dp"))[0].external


def test_gpus_that_pytorch_cannot_see_are_an_error(monkeypatch):
    from ignite_mgpu.gpus import inventory
    from tests.distributed.test_gpu_selection import FOUR_A100

    monkeypatch.setattr(inventory, "query_gpus", lambda run=None: FOUR_A100)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    with pytest.raises(ConfigError, match=r"--gpus 2,3 selects GPUs that nvidia-smi shows, but PyTorch sees no CUDA"):
        make_plan(DistConfig(gpus="2,3"))[0]


def test_a_job_on_chosen_gpus_runs_in_a_fresh_process_even_alone(cuda, monkeypatch):
    from ignite_mgpu.gpus import inventory
    from tests.distributed.test_gpu_selection import FOUR_A100

    monkeypatch.setattr(inventory, "query_gpus", lambda run=None: FOUR_A100)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    cuda(1)  # what torch reports after CUDA_VISIBLE_DEVICES=2 (counted afresh)
    plan, held = make_plan(DistConfig(gpus="2"))
    assert (plan.nproc, plan.backend, plan.spawn_one, plan.device) == (1, None, True, "cuda")
    held.close()  # its claim on GPU 2: the next plan takes every GPU
    assert not make_plan(DistConfig())[0].spawn_one  # without --gpus the one process runs here, as before


def test_restarts_and_preemption_in_the_plan(monkeypatch):
    import signal

    plan = make_plan(DistConfig(nproc=2, max_restarts=3))[0]
    assert (plan.max_restarts, plan.preempt_signal) == (3, signal.SIGUSR1)
    alone = make_plan(DistConfig(max_restarts=1))[0]  # a restart needs a process to restart: spawned even alone
    assert (alone.nproc, alone.backend, alone.spawn_one) == (1, None, True)
    assert make_plan(DistConfig(preempt_signal=None))[0].preempt_signal is None
    for spelling in ("USR2", "usr2", "SIGUSR2"):  # as --preempt-signal and sbatch --signal spell it
        assert load_config(overrides=[f"dist.preempt_signal={spelling}"]).dist.preempt_signal == spelling
        assert make_plan(DistConfig(preempt_signal=spelling))[0].preempt_signal == signal.SIGUSR2


def test_jobs_that_join_the_group_fork_from_the_server_and_scripts_spawn():
    assert make_plan(DistConfig(nproc=2))[0].start_method == "forkserver"
    assert make_plan(DistConfig(nproc=2), join_group=False)[0].start_method == "spawn"  # ignite-mgpu run: fresh python


def test_max_restarts_under_torchrun_is_refused(torchrun):
    torchrun(local_world=2, world=2)
    with pytest.raises(ConfigError, match=r"^--max-restarts 2: this process was started by torchrun/SLURM, which"):
        make_plan(DistConfig(max_restarts=2))[0]
    assert make_plan(DistConfig())[0].preempt_signal is not None  # srun's tasks stop on SLURM's warning too


def test_fsdp_with_fewer_processes_than_chosen_gpus_is_refused(cuda, monkeypatch):
    from ignite_mgpu.gpus import inventory
    from tests.distributed.test_gpu_selection import FOUR_A100

    monkeypatch.setattr(inventory, "query_gpus", lambda run=None: FOUR_A100)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    cuda(2)  # what torch reports after CUDA_VISIBLE_DEVICES=2,3
    with pytest.raises(ConfigError, match=r"--strategy fsdp with --nproc 1 on the 2 GPUs that --gpus 2,3 selects"):
        make_plan(DistConfig(strategy="fsdp", gpus="2,3", nproc=1))[0]
    plan = make_plan(DistConfig(strategy="fsdp", gpus="2,3"))[0]
    assert (plan.nproc, plan.backend, plan.device) == (2, "nccl", "cuda")  # a process per GPU, as ddp


def test_deciding_is_pure_over_the_config_and_a_machine_snapshot():
    from ignite_mgpu.processes.machine import Machine
    from ignite_mgpu.processes.plan import decide

    before = dict(os.environ)
    plan = decide(DistConfig(nproc=2), None, Machine(cuda_devices=0, cpu_count=8), {})
    assert (plan.backend, plan.nproc, plan.device, plan.env["OMP_NUM_THREADS"]) == ("gloo", 2, "cpu", "4")
    assert plan.env["GLOO_SOCKET_IFNAME"] == "lo" and plan.binding.mode == "none"  # binding: make_plan's, not here
    kept = decide(DistConfig(nproc=2), None, Machine(cuda_devices=0, loopback=False), {"OMP_NUM_THREADS": "3"})
    assert "OMP_NUM_THREADS" not in kept.env and "GLOO_SOCKET_IFNAME" not in kept.env
    on_gpus = decide(DistConfig(), None, Machine(cuda_devices=4), {})
    assert (on_gpus.backend, on_gpus.nproc, on_gpus.device) == ("nccl", 4, "cuda")
    assert dict(os.environ) == before  # nothing applied while deciding
    with pytest.raises(ConfigError, match="--backend nccl needs CUDA"):
        decide(DistConfig(backend="nccl"), None, Machine(cuda_devices=0), {})


def test_a_plan_with_fewer_processes_shares_the_cpus_again_and_needs_no_group_alone():
    # What `ignite-mgpu scale` measures at each size on the CPU (LaunchPlan.with_processes).
    from ignite_mgpu.processes.machine import Machine
    from ignite_mgpu.processes.plan import decide

    plan = decide(DistConfig(nproc=4), None, Machine(cuda_devices=0, cpu_count=8), {})
    two, one = plan.with_processes(2), plan.with_processes(1)
    assert (two.nproc, two.backend, two.env["OMP_NUM_THREADS"]) == (2, "gloo", "4")
    assert (one.nproc, one.backend, one.env["OMP_NUM_THREADS"]) == (1, None, "8")
    assert plan.env["OMP_NUM_THREADS"] == "2" and plan.nproc == 4  # the plan itself never changes
