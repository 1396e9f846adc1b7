"""Sharded checkpoint folders in one process (no process group: torch.distributed.checkpoint writes and reads every
shard itself): atomic writing, rotation, completeness, resume's loading, the torch.load error, inspect and convert.
The 2-process folders are in tests/distributed/test_fsdp.py. `python -m pytest tests/checkpoint/test_sharded.py`."""

import logging
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from ignite_mgpu.checkpoint.files import clean_stale_temp_files, find_resumable, list_checkpoints, read_checkpoint
from ignite_mgpu.checkpoint.load import load_checkpoint
from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint, load_sharded
from ignite_mgpu.cli.commands import main
from ignite_mgpu.errors import CheckpointError
from tests.helpers import small


class Counter:
    """A stand-in for the trainer, the scheduler, the run info: anything with a state_dict."""

    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"iteration": self.n}

    def load_state_dict(self, state):
        self.n = state["iteration"]


def objects(seed=0):
    torch.manual_seed(seed)
    model = small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer, "trainer": Counter()}


def train_step(to_save, n):
    to_save["model"](torch.randn(3, 4)).sum().backward()
    to_save["optimizer"].step()
    to_save["optimizer"].zero_grad()
    to_save["trainer"].n = n


def save(to_save, folder, n_saved=2):
    ShardedCheckpoint(to_save, folder, n_saved)(SimpleNamespace(state=SimpleNamespace(iteration=to_save["trainer"].n)))


def test_folders_are_written_whole_rotated_and_resumed(tmp_path):
    saved = objects()
    for n in (4, 8, 12):
        train_step(saved, n)
        save(saved, tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_12", "checkpoint_8"]  # n_saved=2
    folder = tmp_path / "checkpoint_12"
    assert (folder / ".metadata").is_file() and (folder / "train_state.pt").is_file()
    assert not list(tmp_path.glob(".tmp-*"))

    fresh = objects(seed=1)  # another initialisation and no optimizer state yet: all of it comes from the folder
    load_sharded(folder, fresh)
    torch.testing.assert_close(fresh["model"].state_dict(), saved["model"].state_dict())
    torch.testing.assert_close(fresh["optimizer"].state_dict(), saved["optimizer"].state_dict())
    assert fresh["trainer"].n == 12

    other = {"model": nn.Linear(4, 2), "optimizer": None, "trainer": Counter()}
    with pytest.raises(CheckpointError, match=r"checkpoint_12 does not match the model \(2 missing keys"):
        load_sharded(folder, other)


def test_train_state_is_read_onto_the_cpu(tmp_path, monkeypatch):
    # Issue #44 (1): train_state.pt's tensors (numpy's RNG key under train.deterministic) stay on the CPU whatever
    # the rank's device ("meta" here, which no tensor may reach).
    to_save = {**objects(), "rng": SimpleNamespace(state_dict=lambda: {"key": torch.arange(3)})}
    train_step(to_save, 4)
    save(to_save, tmp_path)
    monkeypatch.setattr("ignite.distributed.device", lambda: torch.device("meta"))
    loaded = []
    fresh = {**objects(seed=1), "rng": SimpleNamespace(load_state_dict=loaded.append)}
    load_sharded(tmp_path / "checkpoint_4", fresh)
    assert fresh["trainer"].n == 4 and loaded[0]["key"].device.type == "cpu"
    assert all(s["step"].device.type == "cpu" for s in fresh["optimizer"].state.values())


def test_incomplete_folders_are_skipped_and_stale_ones_removed(tmp_path, caplog):
    to_save = objects()
    train_step(to_save, 4)
    save(to_save, tmp_path)
    (tmp_path / "checkpoint_8").mkdir()  # no .metadata: its writer was stopped
    (tmp_path / ".tmp-checkpoint_12").mkdir()  # a killed writer's temporary folder
    with caplog.at_level(logging.WARNING):
        assert find_resumable(tmp_path) == tmp_path / "checkpoint_4"
    assert "skipping" in caplog.text and "incomplete sharded checkpoint (no .metadata or train_state.pt)" in caplog.text
    clean_stale_temp_files(tmp_path)
    assert not (tmp_path / ".tmp-checkpoint_12").exists()


def test_torch_load_paths_refuse_a_folder_with_the_fix(tmp_path):
    to_save = objects()
    train_step(to_save, 4)
    save(to_save, tmp_path)
    folder = tmp_path / "checkpoint_4"
    message = r"is a sharded checkpoint folder \(checkpoint.format=sharded.*ignite-mgpu checkpoint convert"
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(folder)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder, {"model": small()})


def test_inspect_and_convert_read_folders(tmp_path):
    to_save = objects()
    train_step(to_save, 4)
    save(to_save, tmp_path)
    folder = str(tmp_path / "checkpoint_4")
    out = CliRunner().invoke(main, ["checkpoint", "inspect", folder])
    assert out.exit_code == 0, out.output
    assert "kind: sharded checkpoint" in out.output and "parameters: 23" in out.output and "iteration: 4" in out.output
    converted = CliRunner().invoke(main, ["checkpoint", "convert", folder, str(tmp_path / "model.pt")])
    assert converted.exit_code == 0 and f"(the model of sharded checkpoint {folder})" in converted.output
    model = small()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # plain, loads anywhere
    torch.testing.assert_close(model.state_dict(), to_save["model"].state_dict())
    (tmp_path / "checkpoint_8").mkdir()
    broken = CliRunner().invoke(main, ["checkpoint", "inspect", str(tmp_path / "checkpoint_8")])
    assert broken.exit_code == 2 and "incomplete sharded checkpoint: it has no .metadata" in broken.output
