"""The launch plan, decided in the parent without spawning anything. `python -m pytest tests/test_launcher.py`."""

import os

import pytest

from ignite_mgpu.config import ConfigError, DistConfig, load_config
from ignite_mgpu.launcher import make_plan


def test_cpu_defaults(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    plan = make_plan(DistConfig())
    assert (plan.nproc, plan.backend, plan.world_size, plan.external) == (1, None, 1, False)
    two = make_plan(DistConfig(nproc=2))
    assert two.backend == "gloo" and two.env.get("OMP_NUM_THREADS") == "4"  # 8 cores split over 2 processes
    assert two.env.get("GLOO_SOCKET_IFNAME") == "lo"  # a single-node job listens on loopback only
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in make_plan(DistConfig(nproc=2)).env  # the user's choice is kept


def test_under_torchrun_the_outer_launcher_decides(monkeypatch):
    for key, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    plan = make_plan(DistConfig())
    assert plan.external and plan.nproc == 2 and plan.world_size == 4
    with pytest.raises(ConfigError, match="drop --nproc"):
        make_plan(DistConfig(nproc=2))
    with pytest.raises(ConfigError, match="not --gpus auto"):
        make_plan(DistConfig(gpus="auto:2"))


def test_busy_master_port_is_named():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--master-port {port} is already in use"):
            make_plan(DistConfig(nproc=2, master_port=port))


def test_checkpoints_must_fall_on_optimizer_steps():
    with pytest.raises(ConfigError, match=r"checkpoint.every_iters.*multiple of train.grad_accum_steps=4"):
        load_config(overrides=["train.grad_accum_steps=4", "checkpoint.every_iters=6"])
    assert load_config(overrides=["train.grad_accum_steps=4", "checkpoint.every_iters=8"]).checkpoint.every_iters == 8
