"""Writing checkpoints: unwrapped models, a failed save keeps the previous file, private modes, best-model files
that load into the plain model, the best model by any metric in its direction, rotation after a resume.
`python -m pytest tests/checkpoint/test_save.py`."""

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
    plain = torchvision.models.resnet18(num_classes=10)
    assert not plain.load_state_dict(torch.load(path, weights_only=True)).missing_keys  # no module. prefix
    assert torch.equal(plain.fc.weight, model.fc.weight)


@pytest.mark.parametrize(
    "metric, names, better",
    [
        ("accuracy", ["best_model_1_val_accuracy=0.5000.pt"], 0.6),
        ("loss", ["best_model_1_val_loss=0.5000.pt"], 0.1),  # the loss as reported; lower is better
        ("loss", ["best_model_1_val_loss=-0.5000.pt"], 0.1),  # an older run's name: the loss negated
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
    assert [p.name for p in tmp_path.glob("best_model_*.pt")] == [f"best_model_2_val_{metric}={better:.4f}.pt"]


@pytest.mark.parametrize("old", ["best_model_1_val_loss=0.2000.pt", "best_model_1_val_loss=-0.2000.pt"])
def test_a_worse_loss_keeps_the_best_model_of_the_resumed_run(tmp_path, old):
    torch.save(small().state_dict(), tmp_path / old)
    trainer, evaluator = Engine(lambda e, b: None), Engine(lambda e, b: None)
    trainer.state.epoch = 2
    full, best = create_checkpointers(
        {"model": small(), "trainer": trainer}, small(), tmp_path, 1, "loss", lambda e, _: trainer.state.epoch
    )
    adopt_existing(full, best, tmp_path)
    evaluator.state.metrics = {"loss": 2.4889}
    best(evaluator)
    assert [p.name for p in tmp_path.glob("best_model_*.pt")] == [old]
    evaluator.state.metrics = {"loss": 0.1}
    best(evaluator)
    assert [p.name for p in tmp_path.glob("best_model_*.pt")] == ["best_model_2_val_loss=0.1000.pt"]


@pytest.mark.parametrize(
    "metric, mode, scores, best",
    [
        ("top5", "auto", [0.5, 0.8, 0.7, 0.8], "best_model_2_val_top5=0.8000.pt"),  # higher; a tie keeps the first
        ("perplexity", "auto", [9.0, 7.5, 8.0], "best_model_2_val_perplexity=7.5000.pt"),  # lower
        ("mine", "min", [-1.0, -3.0, -2.0], "best_model_2_val_mine=-3.0000.pt"),  # the user's, lower is better
        ("mine", "max", [-1.0, -3.0, -2.0], "best_model_1_val_mine=-1.0000.pt"),
    ],
)
def test_the_best_model_follows_the_metric_and_its_direction(tmp_path, metric, mode, scores, best):
    from ignite_mgpu.runs.read import best_model

    trainer, evaluator, model = Engine(lambda e, b: None), Engine(lambda e, b: None), small()
    _, handler = create_checkpointers(
        {"trainer": trainer}, model, tmp_path, 1, metric, lambda e, _: trainer.state.epoch, mode
    )
    for epoch, score in enumerate(scores, 1):
        trainer.state.epoch, evaluator.state.metrics = epoch, {metric: score}
        with torch.no_grad():  # every epoch's weights are its number
            for p in model.parameters():
                p.fill_(epoch)
        handler(evaluator)
    assert [p.name for p in tmp_path.glob("best_model_*.pt")] == [best]
    (tmp_path / "config.yaml").write_text(f"checkpoint:\n  metric: {metric}\n  metric_mode: {mode}\n")
    assert best_model(tmp_path) == tmp_path / best
    weights = torch.load(tmp_path / best, weights_only=True)
    assert all(float(t.flatten()[0]) == int(best.split("_")[2]) for t in weights.values())  # that epoch's weights
    # a resumed run adopts the file and keeps it against a worse score, in the same direction
    _, resumed = create_checkpointers({"trainer": trainer}, small(), tmp_path, 1, metric, lambda e, _: 9, mode)
    adopt_existing(Checkpoint({"trainer": trainer}, SafeDiskSaver(tmp_path)), resumed, tmp_path, mode)
    evaluator.state.metrics = {metric: scores[0]}
    resumed(evaluator)
    assert [p.name for p in tmp_path.glob("best_model_*.pt")] == [best]


def test_time_based_and_iteration_checkpoints_land_on_window_ends_after_the_epoch_report(tmp_path, monkeypatch):
    """checkpoint.every_minutes on a fake clock (1 s per step, every 3 s), every_iters=4 with windows of 3 in epochs
    of 10, no epoch checkpoints: the files of a 2-epoch run, and the epoch report written before an epoch-end one."""
    from ignite.engine import Events

    from ignite_mgpu.config.schema import CheckpointConfig
    from ignite_mgpu.train.checkpointing import attach_checkpoints
    from ignite_mgpu.train.step import guard as guard_module
    from ignite_mgpu.train.step.trainer import create_trainer
    from tests.helpers import data, linear

    clock = [0.0]
    monkeypatch.setattr(guard_module.time, "monotonic", lambda: clock[0])
    model = linear()
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu", check_every=1,
        grad_accum_steps=3, checkpoint_every_iters=4, checkpoint_every_minutes=0.05,
    )  # fmt: skip
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda: clock.__setitem__(0, clock[0] + 1.0))
    reported = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: reported.append(len(list_checkpoints(tmp_path))))
    evaluator = Engine(lambda e, b: None)
    to_save = {"model": model, "trainer": trainer}
    # synchronous: each file is on disk when its save returns, which the counts at each epoch's report read
    cfg = CheckpointConfig(every=0, every_iters=4, every_minutes=0.05, n_saved=20, async_save=False)
    attach_checkpoints(trainer, evaluator, to_save, cfg, tmp_path, "accuracy")
    trainer.run(data(n=40, batch=4), max_epochs=2)
    # Iterations: multiples 4, 8, 12, 16, 20 -> the ends of their windows 6, 9, 13, 16 and the epoch end 20. Time
    # (checks on window ends: 3, 6, 9, 10, 13, ...): 3 s after the checkpoint of 16, at 19.
    saved = sorted(int(p.stem.split("_")[1]) for p in list_checkpoints(tmp_path))
    assert saved == [6, 9, 13, 16, 19, 20]
    assert reported == [2, 5]  # epoch 2's end checkpoint (20) came after its report
