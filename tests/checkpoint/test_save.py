"""Writing checkpoints: unwrapped models, a failed save keeps the previous file, private modes, best-model files
that load into the plain model, rotation after a resume. `python -m pytest tests/checkpoint/test_save.py`."""

import os
import stat

import pytest
import torch
import torchvision
from ignite.engine import Engine
from ignite.handlers import Checkpoint
from torch import nn

from ignite_mgpu.checkpoint.files import is_complete, list_checkpoints
from ignite_mgpu.checkpoint.save import SafeDiskSaver, adopt_existing, create_checkpointers
from ignite_mgpu.errors import CheckpointError
from tests.helpers import small


def test_checkpoint_saved_from_ddp_like_wrapper_has_no_prefix(tmp_path):
    model = nn.DataParallel(small())  # ignite's Checkpoint unwraps DP/DDP
    saver = SafeDiskSaver(tmp_path)
    Checkpoint({"model": model}, saver, filename_prefix="best")(Engine(lambda e, b: None))
    (path,) = tmp_path.glob("best_*.pt")
    state = torch.load(path, weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    small().load_state_dict(state)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = small()
    trainer = Engine(lambda e, b: None)
    handler = Checkpoint(
        {"model": model, "trainer": trainer},
        SafeDiskSaver(tmp_path),
        n_saved=1,
        global_step_transform=lambda e, _: e.state.iteration,
    )
    trainer.state.iteration = 2
    handler(trainer)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_2.pt"]

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    trainer.state.iteration = 4
    with pytest.raises(CheckpointError, match=r"saving checkpoint_4.pt failed.*No space.*kept.*checkpoint_2"):
        handler(trainer)
    assert os.listdir(tmp_path) == ["checkpoint_2.pt"]  # no temp file, the old one kept
    assert is_complete(tmp_path / "checkpoint_2.pt")
    monkeypatch.undo()
    trainer.state.iteration = 6
    handler(trainer)  # the next good save removes the stale one only after writing
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_6.pt"]


def test_files_are_private(tmp_path):
    trainer = Engine(lambda e, b: None)
    Checkpoint({"model": small(), "trainer": trainer}, SafeDiskSaver(tmp_path))(trainer)
    for path in tmp_path.glob("*.pt"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_best_model_loads_into_torchvision_resnet(tmp_path):
    model = torchvision.models.resnet18(num_classes=10)
    evaluator = Engine(lambda e, b: None)
    evaluator.state.metrics = {"accuracy": 0.5}
    trainer = Engine(lambda e, b: None)
    trainer.state.epoch = 3
    _, best = create_checkpointers(
        {"model": model}, nn.DataParallel(model), tmp_path, 1, "accuracy", lambda e, _: trainer.state.epoch
    )
    best(evaluator)
    (path,) = tmp_path.glob("best_model_3_val_accuracy=0.5000.pt")
    torchvision.models.resnet18(num_classes=10).load_state_dict(torch.load(path, weights_only=True))


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
    full, best = create_checkpointers(
        {"model": small(), "trainer": trainer}, small(), tmp_path, 1, metric, lambda e, _: trainer.state.epoch
    )
    adopt_existing(full, best, tmp_path)
    evaluator.state.metrics = {metric: better}
    best(evaluator)
    assert [p.name for p in tmp_path.glob("best_model_*.pt")] == [
        f"best_model_2_val_{metric}={better if metric == 'accuracy' else -better:.4f}.pt"
    ]
