"""Resuming in one process: the run signature, a checkpoint of another run refused before anything is loaded, and
a finished run left alone. The multi-process resumes are in tests/distributed. `python -m pytest
tests/checkpoint/test_resume.py`."""

import pytest
import torch
from ignite.handlers import Checkpoint
from torch import nn

from ignite_mgpu.checkpoint.resume import resume
from ignite_mgpu.checkpoint.same_run import run_signature
from ignite_mgpu.checkpoint.save import RunInfo, SafeDiskSaver
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.errors import CheckpointError
from ignite_mgpu.train.step.trainer import create_trainer
from tests.helpers import data, linear


def test_the_signature_holds_what_defines_a_run():
    signature = run_signature(load_config(overrides=["optim.lr=0.1", "train.epochs=5", "dist.nproc=2"]))
    assert signature["optim.lr"] == "0.1" and signature["model.name"] == "simple_cnn"
    assert not [k for k in signature if k.startswith(("train.epochs", "dist.", "checkpoint.", "output_dir"))]


def objects(cfg):
    model = linear(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss(), device="cpu")
    return {
        "model": model,
        "optimizer": optimizer,
        "trainer": trainer,
        "run": RunInfo(1, cfg.data.batch_size, run_signature(cfg)),
    }


@pytest.fixture
def saved(tmp_path):
    """A run of 2 epochs x 4 iterations, checkpointed at its end into tmp_path."""
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "train.epochs=2"])
    to_save = objects(cfg)
    to_save["trainer"].run(data(n=32, batch=8), max_epochs=2)
    Checkpoint(to_save, SafeDiskSaver(tmp_path), global_step_transform=lambda e, _: e.state.iteration)(
        to_save["trainer"]
    )
    return to_save["model"]


def test_a_checkpoint_of_other_settings_is_refused_before_anything_is_loaded(tmp_path, saved):
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "resume=auto", "train.epochs=3", "optim.lr=0.1"])
    fresh = objects(cfg)
    before = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    with pytest.raises(CheckpointError, match=r"other settings \(optim.lr: 0.05 -> 0.1\).*allow_config_change=true"):
        resume(cfg, fresh, world_size=1)
    assert all(torch.equal(before[k], v) for k, v in fresh["model"].state_dict().items())
    allowed = load_config(
        overrides=[
            *(f"{k}={v}" for k, v in {"output_dir": tmp_path, "resume": "auto"}.items()),
            "train.epochs=3",
            "optim.lr=0.1",
            "checkpoint.allow_config_change=true",
        ]
    )
    assert resume(allowed, fresh, world_size=1)  # one more epoch to train
    assert fresh["trainer"].state.iteration == 8
    assert all(torch.equal(a, b) for a, b in zip(fresh["model"].parameters(), saved.parameters(), strict=True))


def test_a_finished_run_has_nothing_left_to_train(tmp_path, saved, caplog):
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "resume=auto", "train.epochs=2"])
    assert not resume(cfg, objects(cfg), world_size=1)
    assert "already finished 2 epochs (train.epochs=2)" in caplog.text


def test_a_finished_run_is_said_once_by_rank_0(tmp_path, saved, caplog, monkeypatch):
    import ignite.distributed as idist

    monkeypatch.setattr(idist, "get_rank", lambda: 1)  # the other ranks stop as rank 0 does, silently
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "resume=auto", "train.epochs=2"])
    assert not resume(cfg, objects(cfg), world_size=1)
    assert "already finished" not in caplog.text


def test_resume_auto_in_an_empty_folder_starts_a_new_run(tmp_path, caplog):
    # The same command on the first start and on every restart by torchrun / SLURM (issue #14).
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "resume=auto"])
    fresh = objects(cfg)
    before = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    assert resume(cfg, fresh, world_size=1)  # something to train
    assert fresh["trainer"].state.iteration == 0
    assert all(torch.equal(before[k], v) for k, v in fresh["model"].state_dict().items())
    assert f"--resume auto: no complete checkpoint in {tmp_path} yet: starting a new run" in caplog.text


def test_a_resume_reads_onto_the_cpu_and_each_state_dict_places_its_tensors(tmp_path, monkeypatch):
    # Issue #44 (1, 2): a checkpoint read onto this rank's GPU left AdamW's state["step"] there (a sync per
    # parameter per step) and numpy's RNG key a CUDA tensor (.numpy() fails). Here the rank's device is "meta", which
    # no tensor may reach: everything is read onto the CPU, and load_state_dict places it.
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "resume=auto", "train.epochs=2"])
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic mode sets: restored after the test
    mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()

    def adamw_objects():
        model = linear(seed=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss(), device="cpu", deterministic=True)
        return {
            "model": model,
            "optimizer": optimizer,
            "trainer": trainer,
            "run": RunInfo(1, cfg.data.batch_size, run_signature(cfg)),
        }

    saved = adamw_objects()
    saved["trainer"].run(data(n=32, batch=8), max_epochs=1)
    Checkpoint(saved, SafeDiskSaver(tmp_path), global_step_transform=lambda e, _: e.state.iteration)(saved["trainer"])
    monkeypatch.setattr("ignite.distributed.device", lambda: torch.device("meta"))
    fresh = adamw_objects()
    assert resume(cfg, fresh, world_size=1)
    states = list(fresh["optimizer"].state.values())
    assert states and all(s["step"].device.type == "cpu" and s["step"].item() == 4 for s in states)
    assert all(s["exp_avg"].device == p.device for s, p in zip(states, fresh["model"].parameters(), strict=True))
    assert fresh["trainer"].state.iteration == 4
    torch.testing.assert_close(fresh["optimizer"].state_dict(), saved["optimizer"].state_dict())
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
