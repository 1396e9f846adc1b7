"""The epoch log in one process: one JSON line per epoch in metrics.jsonl whose figures agree with the engines,
and the data-wait share that tells a slow loader. The 2-rank version is in tests/distributed/test_training.py.
`python -m pytest tests/train/test_epoch_log.py`."""

import json
import time

import ignite.distributed as idist
import pytest
import torch
from ignite.engine import Events
from ignite.metrics import Accuracy, Loss
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ignite_mgpu.train.epoch_log import EpochLog
from ignite_mgpu.train.evaluator import create_evaluator
from ignite_mgpu.train.step.trainer import create_trainer
from tests.helpers import data, linear


def train_with_report(tmp_path, loader, epochs=2):
    model = linear()
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu")
    evaluator = create_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(nn.CrossEntropyLoss())}, device="cpu")
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(data(n=16)))
    epoch_log = EpochLog(tmp_path / "metrics.jsonl", loader.batch_size, evaluator, [torch.device("cpu")])
    epoch_log.attach(trainer)
    trainer.run(loader, max_epochs=epochs)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return trainer, evaluator, epoch_log, rows


class SlowItems(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.zeros(6), 0


def test_one_line_per_epoch_agreeing_with_the_engines(tmp_path):
    # 10 ms per sample: epochs long enough that the rounded epoch time (1 ms) hardly changes the rates.
    trainer, evaluator, epoch_log, rows = train_with_report(tmp_path, DataLoader(SlowItems(), batch_size=8))
    assert [r["epoch"] for r in rows] == [1, 2] and [r["iteration"] for r in rows] == [2, 4]
    last = rows[-1]
    assert last == epoch_log.last
    assert last["train_loss"] == pytest.approx(trainer.state.metrics["train_loss"])
    assert last["val_loss"] == pytest.approx(evaluator.state.metrics["loss"])
    assert last["val_accuracy"] == pytest.approx(evaluator.state.metrics["accuracy"])
    assert last["samples_per_s"] == pytest.approx(2 * 8 / last["epoch_time_s"], rel=0.01)
    assert last["time_per_iter_ms"] == pytest.approx(1000 * last["epoch_time_s"] / 2, rel=0.01)
    assert len(last["peak_memory_mb"]) == 1 and last["peak_memory_mb"][0] > 50  # this process's RSS
    assert last["memory_imbalance"] == 1.0 and 0 <= last["data_wait_share"] <= 1
    assert last["peak_memory_per"] == "process" and epoch_log.memory_tags() == ["memory/rank0"]
    assert last["restarts"] == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_data_wait_is_counted_by_a_timed_loader_or_by_two_handlers(tmp_path, deterministic, monkeypatch):
    """The default job's TimedDataLoader counts the wait without a per-iteration handler (also after ignite's
    DeterministicEngine rebuilt it); any other loader gets the two handlers around the fetch. Either way, a loader
    that sleeps 80 ms per batch around a trivial step waits for most of the epoch."""
    from ignite_mgpu.train.data.loaders import TimedDataLoader, timed

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic mode sets: restored after the test
    mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        for loader in (timed(DataLoader(SlowItems(), batch_size=8)), DataLoader(SlowItems(), batch_size=8)):
            waits, handlers, kind = data_wait(tmp_path, loader, deterministic)
            assert [w > 0.5 for w in waits] == [True, True], waits
            assert handlers == (0 if isinstance(loader, TimedDataLoader) else 1)
            assert kind is type(loader)  # rebuilt by DeterministicEngine: the same kind of loader
    finally:
        torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
    assert loader.batch_size == 8 and len(list(timed(loader))) == 2 and timed(loader).wait_seconds > 0.1


def data_wait(tmp_path, loader, deterministic):
    """Each epoch's data_wait_share, the handlers on GET_BATCH_STARTED, the kind of loader the trainer ran."""
    model = linear()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, sgd, nn.CrossEntropyLoss(), device="cpu", deterministic=deterministic)
    evaluator = create_evaluator(model, {"loss": Loss(nn.CrossEntropyLoss())}, device="cpu")
    (tmp_path / "m.jsonl").unlink(missing_ok=True)
    EpochLog(tmp_path / "m.jsonl", 8, evaluator, [torch.device("cpu")]).attach(trainer)
    trainer.run(loader, max_epochs=2)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    handlers = len(trainer._event_handlers[Events.GET_BATCH_STARTED])
    return [r["data_wait_share"] for r in rows], handlers, type(trainer.state.dataloader)


def test_tensorboard_tags_name_each_gpu_of_one_process_or_each_rank(monkeypatch):
    gpus = [torch.device("cuda", k) for k in range(3)]  # device objects only: no CUDA needed
    assert EpochLog("unused", 8, None, gpus).memory_tags() == ["memory/gpu0", "memory/gpu1", "memory/gpu2"]  # dp
    monkeypatch.setattr(idist, "get_world_size", lambda: 2)
    assert EpochLog("unused", 8, None, gpus[1:2]).memory_tags() == ["memory/rank0", "memory/rank1"]


def test_a_slow_loader_shows_in_the_data_wait_share(tmp_path):
    *_, rows = train_with_report(tmp_path, DataLoader(SlowItems(), batch_size=8), epochs=1)
    assert rows[0]["data_wait_share"] > 0.5  # 80 ms of loading against well under a millisecond of training
    (tmp_path / "fast").mkdir()
    *_, fast = train_with_report(tmp_path / "fast", data(), epochs=1)
    assert fast[0]["data_wait_share"] < rows[0]["data_wait_share"]


def test_a_resumed_run_records_each_epoch_once(tmp_path):
    # The interrupted run wrote epochs 1-3 (and half of a line) after its checkpoint of epoch 2: resuming from it
    # drops epoch 3, whose row the resumed run writes again, with its restart count.
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"epoch": e, "restarts": 0}) + "\n" for e in (1, 2, 3)) + '{"epoch": 4, "tr')
    epoch_log = EpochLog(path, 8, None, [torch.device("cpu")], restarts=1)
    epoch_log.drop_epochs_after(2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"epoch": 1, "restarts": 0},
        {"epoch": 2, "restarts": 0},
    ]
    epoch_log.drop_epochs_after(0)  # restarted from the beginning
    assert path.read_text() == "" and not list(tmp_path.glob(".*tmp"))
    EpochLog(tmp_path / "none.jsonl", 8, None, [torch.device("cpu")]).drop_epochs_after(3)  # nothing to do
    assert not (tmp_path / "none.jsonl").exists()


def test_the_step_split_and_its_verdict_in_one_process(tmp_path):
    """A loader that sleeps 80 ms per batch around a trivial step: the split's data part is most of the step, the
    job is judged bound by data, and one plain process waits for no gradient sync."""
    from ignite_mgpu.train.data.loaders import timed

    _, _, epoch_log, rows = train_with_report(tmp_path, timed(DataLoader(SlowItems(), batch_size=8)))
    last = rows[-1]
    assert last["time_data_ms"][0] > 60 and last["time_comm_ms"] == [0.0]
    assert last["time_compute_ms"][0] > 0 and last["time_optimizer_ms"][0] > 0
    parts = sum(last[f"time_{k}_ms"][0] for k in ("data", "compute", "comm", "optimizer"))
    assert parts <= last["time_per_iter_ms"] * 1.01
    assert last["slowest_rank"] is None and last["bound_by"] == "data"
    verdict = epoch_log.verdict()
    assert verdict is not None and verdict.words.startswith("bound by data: the ranks wait")
