"""Checkpoint files: prefix stripping, bare/full files, weights_only refusal of pickled code, truncation,
failed saves that keep the previous file, private file modes. `python -m pytest tests/test_checkpoint.py`."""

import os
import pickle
import stat

import pytest
import torch
import torchvision
from click.testing import CliRunner
from ignite.engine import Engine
from ignite.handlers import Checkpoint
from torch import nn

from ignite_mgpu import checkpoint as ckpt
from ignite_mgpu import handlers
from ignite_mgpu.cli import main


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_legacy_dataparallel_file_loads_into_the_plain_model(tmp_path):
    src = small()
    torch.save(nn.DataParallel(src).state_dict(), tmp_path / "legacy.pt")  # every key starts with module.
    target = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    ckpt.load_checkpoint(tmp_path / "legacy.pt", {"model": target}, map_location="cpu")
    for a, b in zip(src.state_dict().values(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_compiled_and_wrapped_prefixes_are_stripped():
    state = {"module._orig_mod.0.weight": torch.ones(1)}
    assert ckpt.strip_prefixes(state) == ({"0.weight": state["module._orig_mod.0.weight"]}, ["module.", "_orig_mod."])
    mixed = {"module.a": torch.ones(1), "b": torch.ones(1)}
    assert ckpt.strip_prefixes(mixed)[1] == []  # only when every key has it


def test_checkpoint_saved_from_ddp_like_wrapper_has_no_prefix(tmp_path):
    model = nn.DataParallel(small())  # ignite's Checkpoint unwraps DP/DDP
    saver = handlers.SafeDiskSaver(tmp_path)
    Checkpoint({"model": model}, saver, filename_prefix="best")(Engine(lambda e, b: None))
    (path,) = tmp_path.glob("best_*.pt")
    state = torch.load(path, weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    small().load_state_dict(state)


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['SENTINEL']}",))


def test_pickled_code_is_refused_not_executed(tmp_path, monkeypatch):
    sentinel = tmp_path / "SENTINEL"
    monkeypatch.setenv("SENTINEL", str(sentinel))
    with open(tmp_path / "evil.pt", "wb") as f:
        torch.save({"model": Evil()}, f)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load.*NOT executed"):
        ckpt.load_checkpoint(tmp_path / "evil.pt", {"model": small()}, map_location="cpu")
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps(Evil()))  # not even a zip archive
    with pytest.raises(ckpt.CheckpointError):
        ckpt.read_checkpoint(raw)
    assert not sentinel.exists()


def test_truncated_file_is_reported_and_skipped(tmp_path):
    good = {"model": small().state_dict(), "trainer": {"iteration": 2}}
    torch.save(good, tmp_path / "checkpoint_2.pt")
    torch.save(good, tmp_path / "checkpoint_4.pt")
    data = (tmp_path / "checkpoint_4.pt").read_bytes()
    (tmp_path / "checkpoint_4.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "checkpoint_6.pt").write_bytes(b"")
    assert ckpt.find_resumable(tmp_path) == tmp_path / "checkpoint_2.pt"
    with pytest.raises(ckpt.CheckpointError, match="corrupt or truncated"):
        ckpt.read_checkpoint(tmp_path / "checkpoint_4.pt")


def test_mismatched_model_lists_keys_and_loads_nothing(tmp_path):
    torch.save(small().state_dict(), tmp_path / "a.pt")
    other = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=r"missing keys: 3.weight.*shape mismatches: 0.weight"):
        ckpt.load_checkpoint(tmp_path / "a.pt", {"model": other}, map_location="cpu")
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.read_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(ckpt.CheckpointError, match="has no optimizer"):
        ckpt.load_checkpoint(tmp_path / "a.pt", {"model": small(), "optimizer": None}, map_location="cpu")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = small()
    trainer = Engine(lambda e, b: None)
    handler = Checkpoint(
        {"model": model, "trainer": trainer},
        handlers.SafeDiskSaver(tmp_path),
        n_saved=1,
        global_step_transform=lambda e, _: e.state.iteration,
    )
    trainer.state.iteration = 2
    handler(trainer)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint_2.pt"]

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    trainer.state.iteration = 4
    with pytest.raises(ckpt.CheckpointError, match=r"saving checkpoint_4.pt failed.*No space.*kept.*checkpoint_2"):
        handler(trainer)
    assert os.listdir(tmp_path) == ["checkpoint_2.pt"]  # no temp file, the old one kept
    assert ckpt.is_complete(tmp_path / "checkpoint_2.pt")
    monkeypatch.undo()
    trainer.state.iteration = 6
    handler(trainer)  # the next good save removes the stale one only after writing
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_6.pt"]


def test_files_are_private(tmp_path):
    trainer = Engine(lambda e, b: None)
    Checkpoint({"model": small(), "trainer": trainer}, handlers.SafeDiskSaver(tmp_path))(trainer)
    for path in tmp_path.glob("*.pt"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_best_model_loads_into_torchvision_resnet(tmp_path):
    model = torchvision.models.resnet18(num_classes=10)
    evaluator = Engine(lambda e, b: None)
    evaluator.state.metrics = {"accuracy": 0.5}
    trainer = Engine(lambda e, b: None)
    trainer.state.epoch = 3
    _, best = handlers.create_checkpointers(
        {"model": model}, nn.DataParallel(model), tmp_path, 1, "accuracy", lambda e, _: trainer.state.epoch
    )
    best(evaluator)
    (path,) = tmp_path.glob("best_model_3_val_accuracy=0.5000.pt")
    torchvision.models.resnet18(num_classes=10).load_state_dict(torch.load(path, weights_only=True))


def test_inspect_and_convert_cli(tmp_path):
    torch.save(nn.DataParallel(small()).state_dict(), tmp_path / "legacy.pt")
    out = CliRunner().invoke(main, ["checkpoint", "inspect", str(tmp_path / "legacy.pt")]).output
    assert "prefixes: ['module.']" in out and "parameters: 23" in out
    result = CliRunner().invoke(main, ["checkpoint", "convert", str(tmp_path / "legacy.pt"), str(tmp_path / "c.pt")])
    assert result.exit_code == 0 and "stripped module." in result.output
    small().load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    bad = CliRunner().invoke(main, ["checkpoint", "inspect", str(tmp_path / "nope.pt")])
    assert bad.exit_code == 2 and "does not exist" in bad.output


@pytest.mark.parametrize(
    "metric, names, better",
    [
        ("accuracy", ["best_model_1_val_accuracy=0.5000.pt"], 0.6),
        ("loss", ["best_model_1_val_loss=-0.5000.pt"], 0.1),  # loss scores are stored negated: higher is better
    ],
)
def test_resumed_best_model_rotation(tmp_path, metric, names, better):
    for name in names:
        torch.save(small().state_dict(), tmp_path / name)
    torch.save({"model": small().state_dict()}, tmp_path / "checkpoint_4.pt")
    trainer, evaluator = Engine(lambda e, b: None), Engine(lambda e, b: None)
    trainer.state.epoch = 2
    full, best = handlers.create_checkpointers(
        {"model": small(), "trainer": trainer}, small(), tmp_path, 1, metric, lambda e, _: trainer.state.epoch
    )
    ckpt.adopt_existing(full, best, tmp_path)
    evaluator.state.metrics = {metric: better}
    best(evaluator)
    assert [p.name for p in tmp_path.glob("best_model_*.pt")] == [
        f"best_model_2_val_{metric}={better if metric == 'accuracy' else -better:.4f}.pt"
    ]
