"""Rotation beside corrupt checkpoints: files skipped as corrupt are never counted toward checkpoint.n_saved and
never deleted (moved aside as .corrupt), and n_saved loadable checkpoints stay. `python -m pytest tests/hostile`."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine

from ignite_mgpu.checkpoint.files import find_resumable, is_complete, list_checkpoints
from ignite_mgpu.checkpoint.save import adopt_existing, create_checkpointers
from tests.helpers import small


def _good(path):
    torch.save({"model": small().state_dict()}, path)


def test_rotation_beside_corrupt_checkpoints_keeps_n_saved_good_ones(tmp_path, caplog):
    for it in (2, 4):
        _good(tmp_path / f"checkpoint_{it}.pt")
    _good(tmp_path / "checkpoint_6.pt")
    data = (tmp_path / "checkpoint_6.pt").read_bytes()
    (tmp_path / "checkpoint_6.pt").write_bytes(data[: len(data) // 2])  # truncated
    (tmp_path / "checkpoint_8.pt").write_bytes(b"")  # empty
    assert find_resumable(tmp_path).name == "checkpoint_4.pt"
    trainer, model = Engine(lambda e, b: None), small()
    full, best = create_checkpointers(
        {"model": model, "trainer": trainer}, model, tmp_path, 2, "loss", lambda e, _: trainer.state.epoch
    )
    adopt_existing(full, best, tmp_path)
    for it in (10, 12):  # two more saves: n_saved=2 keeps the two newest good ones, never fewer
        trainer.state.iteration = it
        full(trainer)
        good = [p.name for p in list_checkpoints(tmp_path) if is_complete(p)]
        assert len(good) == 2 and good[0] == f"checkpoint_{it}.pt"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_12.pt", "checkpoint_10.pt"]
    assert sorted(p.name for p in tmp_path.glob("*.corrupt")) == ["checkpoint_6.pt.corrupt", "checkpoint_8.pt.corrupt"]
    assert "moved aside as checkpoint_8.pt.corrupt" in caplog.text


def test_the_first_save_after_corrupt_ones_keeps_the_last_good_checkpoint(tmp_path):
    _good(tmp_path / "checkpoint_4.pt")
    (tmp_path / "checkpoint_6.pt").write_bytes(b"PK\x03\x04 truncated")
    (tmp_path / "checkpoint_8.pt").write_bytes(b"")
    trainer, model = Engine(lambda e, b: None), small()
    full, best = create_checkpointers(
        {"model": model, "trainer": trainer}, model, tmp_path, 2, "loss", lambda e, _: trainer.state.epoch
    )
    adopt_existing(full, best, tmp_path)
    trainer.state.iteration = 10
    full(trainer)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_10.pt", "checkpoint_4.pt"]
    assert all(is_complete(p) for p in list_checkpoints(tmp_path))


def test_an_epoch_resumes_its_loss_sums_only_mid_way_at_their_iteration():
    from types import SimpleNamespace

    from ignite_mgpu.train.step.guard import _resumed_sums

    def state(iteration, saved):
        return SimpleNamespace(iteration=iteration, epoch_length=10, resumed_epoch_loss=saved)

    assert _resumed_sums(state(12, [3.5, 4.0, 12])) == (3.5, 4.0)  # mid-epoch 2, at the saved iteration
    assert _resumed_sums(state(10, [3.5, 4.0, 10])) == (0.0, 0.0)  # an epoch's end: the next epoch starts anew
    assert _resumed_sums(state(12, [3.5, 4.0, 8])) == (0.0, 0.0)  # not this checkpoint's sums
    assert _resumed_sums(state(12, None)) == (0.0, 0.0)  # a checkpoint written before the sums were carried
    once = state(12, [3.5, 4.0, 12])
    _resumed_sums(once)
    assert _resumed_sums(once) == (0.0, 0.0)  # read once: the next epoch starts anew
    from ignite_mgpu.train.default_job import _resumed_epoch_loss

    assert _resumed_epoch_loss({"epoch_losses": [3.5, 4.0, 12], "world_size": 4}) == [3.5, 4.0, 12]
    # Every rank's losses and iterations summed, on 4 processes: the same sums once divided by 4.
    assert _resumed_epoch_loss({"epoch_loss": [14.0, 16.0, 12], "world_size": 4}) == [3.5, 4.0, 12]
    assert _resumed_epoch_loss({"world_size": 4}) is None


def test_sharded_rotation_beside_incomplete_folders_keeps_n_saved_complete_ones(tmp_path):
    from ignite.engine import Engine as _Engine

    from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint
    from tests.checkpoint.test_sharded import objects

    def at(iteration):
        engine = _Engine(lambda e, b: None)
        engine.state.iteration = iteration
        return engine

    to_save = objects()
    handler = ShardedCheckpoint(to_save, tmp_path, 2)
    for it in (2, 4):
        handler(at(it))
    for it in (6, 8):  # incomplete: a killed writer's or a damaged folder
        (tmp_path / f"checkpoint_{it}").mkdir()
    handler(at(10))
    complete = [p.name for p in list_checkpoints(tmp_path) if is_complete(p)]
    assert complete == ["checkpoint_10", "checkpoint_4"]  # n_saved=2 complete ones, never fewer
    assert (tmp_path / "checkpoint_6").is_dir() and (tmp_path / "checkpoint_8").is_dir()  # never deleted silently


@pytest.mark.slow
def test_a_resumed_run_beside_corrupt_checkpoints_keeps_n_saved_loadable_ones(tmp_path):
    from tests.conftest import TINY
    from tests.hostile.bounded import run_bounded

    out = tmp_path / "run"
    args = ["train", "--nproc", "1", "--output-dir", str(out), *TINY, "checkpoint.n_saved=2"]
    first = run_bounded(args, tmp_path, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint_16.pt", "checkpoint_8.pt"]
    data = (out / "checkpoint_16.pt").read_bytes()
    (out / "checkpoint_20.pt").write_bytes(data[: len(data) // 2])  # truncated
    (out / "checkpoint_24.pt").write_bytes(b"")  # empty
    second = run_bounded([*args, "--resume", "auto", "train.epochs=4"], tmp_path, timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "checkpoint_16.pt" in second.stderr
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint_32.pt", "checkpoint_24.pt"]
    assert all(is_complete(p) for p in list_checkpoints(out))
    assert sorted(p.name for p in out.glob("*.corrupt")) == ["checkpoint_20.pt.corrupt", "checkpoint_24.pt.corrupt"]
