"""checkpoint.async_save in one process: the files are the synchronous saver's, bit for bit; the snapshot is the
state at the save; at most one write in flight; rotation only after the new file is complete; a full disk in the
background raises the synchronous saver's CheckpointError at the next save or at the end, deleting nothing; a stop
during a background write finishes it and writes the stop's checkpoint; sharded folders the same.
The killed writer (SIGKILL during a background write, then --resume auto) is tests/faults/test_faults.py's s19.
`python -m pytest tests/checkpoint/test_async.py`."""

import errno
import os
import signal
import threading
import time

import pytest
import torch
from ignite.engine import Engine
from ignite.handlers import Checkpoint

from ignite_mgpu.checkpoint.background import AsyncDiskSaver, stager_available
from ignite_mgpu.checkpoint.files import find_resumable, is_complete, list_checkpoints
from ignite_mgpu.checkpoint.save import SafeDiskSaver, writes_awaited
from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint, load_sharded
from ignite_mgpu.env import stop
from ignite_mgpu.errors import CheckpointError
from tests.checkpoint.test_sharded import objects, train_step

# Where torch.distributed.checkpoint has no DefaultStager, the product refuses or falls back (the test below that
# plants its absence); the background writes themselves cannot be run there.
needs_stager = pytest.mark.skipif(
    not stager_available(),
    reason=f"checkpoint.async_save needs DefaultStager (PyTorch 2.9 or newer); this is PyTorch {torch.__version__}",
)


def step(to_save, n):
    torch.manual_seed(n)  # the same batch for the same n
    train_step(to_save, n)


def assert_same(a, b, where="checkpoint"):
    """Equal structure, types and values; tensors bitwise."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    else:
        assert a == b, where


def handler(to_save, saver, n_saved=2):
    return Checkpoint(to_save, saver, n_saved=n_saved, global_step_transform=lambda e, _: e.state.iteration)


def engine_at(iteration):
    engine = Engine(lambda e, b: None)
    engine.state.iteration = iteration
    return engine


class GatedSave:
    """torch.save that blocks until ``gate`` is set, counting the writes at work at once."""

    def __init__(self, monkeypatch):
        self.real, self.gate, self.active, self.most = torch.save, threading.Event(), 0, 0
        self.gate.set()
        monkeypatch.setattr(torch, "save", self)

    def __call__(self, obj, f, *args, **kwargs):
        self.active += 1
        self.most = max(self.most, self.active)
        try:
            assert self.gate.wait(20)
            return self.real(obj, f, *args, **kwargs)
        finally:
            self.active -= 1


@needs_stager
def test_async_files_equal_the_synchronous_ones(tmp_path):
    a, b = objects(), objects()  # the same seed: the same weights
    sync = handler(a, SafeDiskSaver(tmp_path / "sync"))
    saver = AsyncDiskSaver(tmp_path / "async")
    background = handler(b, saver)
    for n in (2, 4, 6):
        step(a, n)
        step(b, n)
        sync(engine_at(n))
        background(engine_at(n))
        step(b, n + 1)  # changes the live tensors at once: the file must hold the state of the save
        step(a, n + 1)
    saver.finish()
    names = [p.name for p in list_checkpoints(tmp_path / "sync")]
    assert names == ["checkpoint_6.pt", "checkpoint_4.pt"]
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == names
    for name in names:
        assert_same(
            torch.load(tmp_path / "sync" / name, weights_only=True),
            torch.load(tmp_path / "async" / name, weights_only=True),
        )
    assert sorted(os.listdir(tmp_path / "async")) == sorted(names)  # no temp file left


@needs_stager
def test_one_write_in_flight_and_rotation_after_it_completes(tmp_path, monkeypatch):
    to_save, save = objects(), GatedSave(monkeypatch)
    saver = AsyncDiskSaver(tmp_path)
    full = handler(to_save, saver, n_saved=1)
    full(engine_at(2))
    saver.writer.wait()
    save.gate.clear()
    started = time.perf_counter()
    full(engine_at(4))  # returns while the write is blocked
    assert time.perf_counter() - started < 5 and saver.writer.in_flight
    while not save.active and time.perf_counter() - started < 20:  # until the writer thread is in torch.save,
        time.sleep(0.01)  # its temp file open
    train_step(to_save, 5)  # the snapshot is not the live state
    assert sorted(p.name for p in list_checkpoints(tmp_path)) == ["checkpoint_2.pt"]  # not rotated yet
    assert find_resumable(tmp_path) == tmp_path / "checkpoint_2.pt" and list(tmp_path.glob(".tmp-*.pt"))
    second = threading.Thread(target=full, args=(engine_at(6),))
    second.start()
    time.sleep(0.3)
    assert second.is_alive() and save.most == 1  # the next save waits for the write in flight
    save.gate.set()
    second.join(20)
    saver.finish()
    assert save.most == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_6.pt"]
    assert saver.stall_seconds >= 0 and not saver.writer.in_flight
    assert_same(torch.load(tmp_path / "checkpoint_6.pt", weights_only=True)["model"], to_save["model"].state_dict())


def disk_full(obj, f, *args, **kwargs):
    f.write(b"partial bytes")
    raise OSError(errno.ENOSPC, "No space left on device")


@needs_stager
@pytest.mark.parametrize("raised_at", ["the next save", "the end"])
def test_a_full_disk_in_the_background_raises_and_deletes_nothing(tmp_path, monkeypatch, raised_at):
    to_save = objects()
    saver = AsyncDiskSaver(tmp_path)
    full = handler(to_save, saver, n_saved=1)
    full(engine_at(2))
    saver.writer.wait()
    monkeypatch.setattr(torch, "save", disk_full)
    full(engine_at(4))  # the error is in the background
    message = r"saving checkpoint_4.pt failed.*No space.*kept.*checkpoint_2"
    with pytest.raises(CheckpointError, match=message):
        if raised_at == "the next save":
            full(engine_at(6))
        else:
            with writes_awaited(full):
                pass
    assert os.listdir(tmp_path) == ["checkpoint_2.pt"] and is_complete(tmp_path / "checkpoint_2.pt")
    monkeypatch.undo()
    full(engine_at(8))  # the next good write removes the stale one, after it is complete
    saver.finish()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_8.pt"]


def test_a_stop_during_a_background_write_finishes_it_and_saves_the_stop(tmp_path, monkeypatch):
    """SIGTERM's path in the worker: the guard fires STOPPING, whose save waits for the write in flight, writes
    the stop's checkpoint and awaits it before TrainingInterrupted leaves trainer.run."""
    from ignite.engine import Events

    from ignite_mgpu.config.schema import CheckpointConfig
    from ignite_mgpu.errors import TrainingInterrupted
    from ignite_mgpu.train.checkpointing import attach_checkpoints
    from ignite_mgpu.train.step.trainer import create_trainer
    from tests.helpers import data, linear

    save = GatedSave(monkeypatch)
    model = linear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, torch.nn.CrossEntropyLoss(), device="cpu", check_every=1,
                             checkpoint_every_iters=2)  # fmt: skip
    cfg = CheckpointConfig(every=0, every_iters=2, n_saved=2, async_save=True)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    full, _ = attach_checkpoints(trainer, Engine(lambda e, b: None), to_save, cfg, tmp_path, "accuracy")

    def signal_during_the_write(engine):
        save.gate.clear()  # the write of checkpoint_2 hangs until the stop's save has waited a little
        threading.Timer(0.5, save.gate.set).start()
        stop.request_stop(signal.SIGTERM)

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), signal_during_the_write)
    try:
        with pytest.raises(TrainingInterrupted), writes_awaited(full):
            trainer.run(data(n=40, batch=4), max_epochs=1)
    finally:
        stop.reset()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_2.pt", "checkpoint_3.pt"]  # complete files only
    assert all(is_complete(p) for p in list_checkpoints(tmp_path)) and save.most == 1
    assert torch.load(tmp_path / "checkpoint_3.pt", weights_only=True)["trainer"]["iteration"] == 3
    assert trainer.state.checkpoint_saves == 2 and trainer.state.checkpoint_stall > 0.3  # the stop's wait


@needs_stager
def test_sharded_async_folders_equal_the_synchronous_ones(tmp_path):
    a, b = objects(), objects()
    background = ShardedCheckpoint(b, tmp_path / "async", 2, async_save=True)
    for n in (4, 8, 12):
        step(a, n)
        step(b, n)
        ShardedCheckpoint(a, tmp_path / "sync", 2)(engine_at(n))
        background(engine_at(n))
        step(b, n + 1)
        step(a, n + 1)
    background.finish()
    names = [p.name for p in list_checkpoints(tmp_path / "sync")]
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == names == ["checkpoint_12", "checkpoint_8"]
    assert not list((tmp_path / "async").glob(".tmp-*"))
    for name in names:
        loaded = []
        for kind in ("sync", "async"):
            fresh = objects(seed=1)
            load_sharded(tmp_path / kind / name, fresh)
            loaded.append({"model": fresh["model"].state_dict(), "optimizer": fresh["optimizer"].state_dict()})
        assert_same(*loaded)


@needs_stager
def test_sharded_async_write_error_is_raised_and_keeps_the_previous_folder(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    to_save = objects()
    background = ShardedCheckpoint(to_save, tmp_path, 1, async_save=True)
    background(engine_at(4))
    background.finish()

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", no_space)
    background(engine_at(8))
    with pytest.raises(
        CheckpointError,
        match=r"saving checkpoint_8/ failed \(rank 0: .*No space left on device\); kept.*: checkpoint_4$",
    ):
        background.finish()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_4"]
    assert find_resumable(tmp_path) == tmp_path / "checkpoint_4"


def attached(tmp_path, cfg):
    from ignite_mgpu.train.checkpointing import attach_checkpoints
    from ignite_mgpu.train.step.guard import GuardEvents

    to_save = objects()
    trainer = Engine(lambda e, b: None)
    trainer.register_events(*GuardEvents)  # create_trainer's guard adds them
    return attach_checkpoints(trainer, Engine(lambda e, b: None), to_save, cfg, tmp_path, "accuracy")[0]


def writer_of(full):
    """The background writer of attach_checkpoints' full-state handler; None when it saves in the step."""
    if isinstance(full, ShardedCheckpoint):
        return full.writer
    return full.save_handler.writer if isinstance(full.save_handler, AsyncDiskSaver) else None


@needs_stager
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_the_default_writes_in_the_background(tmp_path, fmt):
    from ignite_mgpu.config.schema import CheckpointConfig

    assert CheckpointConfig().async_save
    assert writer_of(attached(tmp_path / "default", CheckpointConfig(format=fmt))) is not None
    assert writer_of(attached(tmp_path / "sync", CheckpointConfig(format=fmt, async_save=False))) is None


def test_a_pytorch_without_the_stager_saves_synchronously_and_says_so(tmp_path, monkeypatch, caplog):
    """PyTorch before 2.9 has no DefaultStager: the default job saves as before and logs it once; a saver built
    by hand for background writes refuses, naming the fix."""
    from ignite_mgpu.checkpoint import background
    from ignite_mgpu.config.schema import CheckpointConfig
    from ignite_mgpu.errors import ConfigError
    from ignite_mgpu.train import checkpointing

    monkeypatch.setattr(checkpointing, "stager_available", lambda: False)
    with caplog.at_level("WARNING", logger=checkpointing.__name__):
        full = attached(tmp_path, CheckpointConfig(every_iters=2))
    assert type(full.save_handler) is SafeDiskSaver
    assert "checkpoints are written synchronously" in caplog.text
    monkeypatch.setattr(background, "stager_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"async_save=true needs .*DefaultStager \(PyTorch 2.9 or newer\).*async_save=false"
    ):
        background.create_stager("cpu")


@needs_stager
@pytest.mark.gpu  # the gpu marker skips on a machine without one: asking torch.cuda here would poison forks
def test_cuda_snapshot_is_pinned_and_the_file_equals_the_synchronous_one(tmp_path):
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    to_save = {"model": model, "optimizer": optimizer}
    handler(to_save, SafeDiskSaver(tmp_path / "sync"))(engine_at(1))
    saver = AsyncDiskSaver(tmp_path / "async", "cuda")
    handler(to_save, saver)(engine_at(1))
    with torch.no_grad():
        model.weight.add_(1.0)  # after the snapshot: not in the file
    saver.finish()
    assert_same(
        torch.load(tmp_path / "sync" / "checkpoint_1.pt", weights_only=True),
        torch.load(tmp_path / "async" / "checkpoint_1.pt", weights_only=True),
    )


class Gathered:
    """As an FSDP model's full state: new CPU tensors at every save."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {k: v.clone() for k, v in self.model.state_dict().items()}


@needs_stager
def test_a_gathered_state_is_written_as_it_is_not_staged_again(tmp_path, monkeypatch):
    # Issue #44 (11): staging a state gathered into new tensors at every save pinned a second copy of it each time.
    from ignite_mgpu.checkpoint import background
    from ignite_mgpu.checkpoint.save import create_checkpointers
    from ignite_mgpu.checkpoint.state import FullModelState

    staged, real = [], background.stage
    monkeypatch.setattr(background, "stage", lambda stager, state: staged.append(list(state)) or real(stager, state))
    a, b = objects(), objects()
    sync = handler({**a, "model": Gathered(a["model"])}, SafeDiskSaver(tmp_path / "sync"))
    saver = AsyncDiskSaver(tmp_path / "async", fresh={"model"})
    background_handler = handler({**b, "model": Gathered(b["model"])}, saver)
    for n in (2, 4):
        step(a, n)
        step(b, n)
        sync(engine_at(n))
        background_handler(engine_at(n))
        step(b, n + 1)
        step(a, n + 1)
    saver.finish()
    assert len(staged) == 2 and all("model" not in keys and "optimizer" in keys for keys in staged)
    for name in ("checkpoint_4.pt", "checkpoint_2.pt"):
        assert_same(
            torch.load(tmp_path / "sync" / name, weights_only=True),
            torch.load(tmp_path / "async" / name, weights_only=True),
        )
    full, _ = create_checkpointers(
        {"model": FullModelState(a["model"]), "optimizer": a["optimizer"]}, a["model"], tmp_path, 1, "loss",
        lambda e, _: 1, async_save=True,
    )  # fmt: skip
    assert full.save_handler.fresh == {"model", "optimizer"}
    full.save_handler.finish()
