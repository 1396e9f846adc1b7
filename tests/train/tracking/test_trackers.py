"""The experiment trackers in one process, on a tiny trainer, without a network: MLflow against a local SQLite
store read back with MlflowClient, W&B offline with its run file read back, TensorBoard's events, the CSV file;
a tracker that raises or cannot start is one warning and the training goes on. The 2-process job is the how-to's
(tests/test_docs.py). `python -m pytest tests/train/tracking/test_trackers.py`."""

from __future__ import annotations

import csv
import json
import logging
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from ignite.metrics import Accuracy, Loss, TopKCategoricalAccuracy
from torch import nn

from ignite_mgpu.config.loading import dump_config, load_config
from ignite_mgpu.errors import TrainingDiverged, TrainingInterrupted
from ignite_mgpu.runs import folder
from ignite_mgpu.train.epoch_log import EpochLog
from ignite_mgpu.train.evaluator import create_evaluator
from ignite_mgpu.train.step.trainer import create_trainer
from ignite_mgpu.train.tracking.csv_logger import COLUMNS, CsvLogger
from ignite_mgpu.train.tracking.trackers import Tracker, Trackers
from tests.helpers import data, linear

EPOCH_LENGTH = 4  # 32 samples in batches of 8


def tiny_run(out: Path, *overrides: str, epochs: int = 2, resume_at: int = 0, restarts: int = 0, groups: int = 1):
    """Train a linear model in this process with the trackers of ``overrides``; ``resume_at``: the iteration
    (a multiple of an epoch) a resumed run continues from. Returns the trainer and the evaluator."""
    cfg = load_config(overrides=[f"output_dir={out}", "train.log_every=2", *overrides])
    out.mkdir(parents=True, exist_ok=True)
    (out / folder.CONFIG).write_text(dump_config(cfg))
    model = linear()
    params = [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.01}][:groups] if groups > 1 else None
    optimizer = torch.optim.SGD(params or model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss(), device="cpu", check_every=2)
    metrics = {"accuracy": Accuracy(), "loss": Loss(nn.CrossEntropyLoss()), "top2": TopKCategoricalAccuracy(2)}
    evaluator = create_evaluator(model, metrics, device="cpu")
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(data(n=16)))
    epoch_log = EpochLog(out / folder.METRICS, 8, evaluator, [torch.device("cpu")], restarts=restarts)
    epoch_log.attach(trainer)
    if resume_at:
        epochs_done = resume_at // EPOCH_LENGTH
        trainer.load_state_dict({"epoch": epochs_done, "max_epochs": epochs, "epoch_length": EPOCH_LENGTH})
    with Trackers(cfg, trainer, evaluator, optimizer, epoch_log, out):
        trainer.run(data(), max_epochs=epochs)
    return trainer, evaluator


def csv_rows(out: Path) -> list[dict[str, str]]:
    with (out / folder.TRACKING_CSV).open(newline="") as f:
        return list(csv.DictReader(f))


def values(rows, name):
    return [(int(r["iteration"]), float(r["value"])) for r in rows if r["name"] == name]


def with_store(out: Path, template: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, out / folder.MLFLOW_DB)
    return out


def test_the_csv_file_has_every_number_in_long_format(tmp_path):
    trainer, evaluator = tiny_run(tmp_path / "run", "train.loggers=[csv]", groups=2)
    rows = csv_rows(tmp_path / "run")
    assert list(rows[0]) == list(COLUMNS)
    assert {r["kind"] for r in rows} == {"run", "train", "val", "epoch"}
    run = {r["name"]: r["value"] for r in rows if r["kind"] == "run"}
    assert run["processes"] == "1" and run["restarts"] == "0" and run["gpus"] == "none" and run["version"]
    assert [i for i, _ in values(rows, "train/loss")] == [2, 4, 6, 8]  # every train.log_every=2 iterations
    assert {r["name"] for r in rows if r["kind"] == "train"} == {"train/loss", "train/lr/0", "train/lr/1"}
    assert values(rows, "train/lr/1") == [(i, 0.01) for i in (2, 4, 6, 8)]  # the second parameter group's
    assert {r["name"] for r in rows if r["kind"] == "val"} == {"val/accuracy", "val/loss", "val/top2"}
    assert values(rows, "val/top2")[-1] == (8, pytest.approx(evaluator.state.metrics["top2"]))
    last = json.loads((tmp_path / "run" / folder.METRICS).read_text().splitlines()[-1])
    epoch = {r["name"]: float(r["value"]) for r in rows if r["kind"] == "epoch" and r["epoch"] == "2"}
    assert epoch["train_loss"] == pytest.approx(last["train_loss"]) and epoch["samples_per_s"] == last["samples_per_s"]
    assert epoch["memory/rank0"] == last["peak_memory_mb"][0] and "data_wait_share" in epoch
    # Each rank's step split, one number each (one process: rank 0; nothing to wait for, 0 ms)
    assert (
        epoch["time_compute_ms/rank0"] == pytest.approx(last["time_compute_ms"][0]) and last["time_compute_ms"][0] > 0
    )
    assert {"time_data_ms/rank0", "time_comm_ms/rank0", "time_optimizer_ms/rank0"} <= set(epoch)


def test_a_resumed_run_drops_the_rows_after_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    tiny_run(out, "train.loggers=[csv]", epochs=2)
    tiny_run(out, "train.loggers=[csv]", "resume=auto", epochs=3, resume_at=4, restarts=1)  # after epoch 1
    rows = csv_rows(out)
    assert [i for i, _ in values(rows, "train/loss")] == [2, 4, 6, 8, 10, 12]  # 6 and 8 once: the redone ones
    assert [r["value"] for r in rows if r["name"] == "restarts" and r["kind"] == "run"] == ["0", "1"]


def test_mlflow_reads_back_the_metrics_params_and_facts(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    out = with_store(tmp_path / "run", mlflow_store)
    tiny_run(out, "train.loggers=[mlflow,csv]", "train.logger_args.mlflow.experiment=tiny", "model.args.hidden=8")
    remembered = json.loads((out / folder.TRACKER_RUNS).read_text())["mlflow"]
    assert remembered["tracking_uri"] == f"sqlite:///{(out / folder.MLFLOW_DB).resolve()}"  # the default store
    client = MlflowClient(remembered["tracking_uri"])
    run = client.get_run(remembered["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    rows = csv_rows(out)
    for name, steps in (("train/loss", "iteration"), ("val/accuracy", "epoch"), ("samples_per_s", "epoch")):
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        expected = [(int(r[steps]), float(r["value"])) for r in rows if r["name"] == name]
        assert history == [(step, pytest.approx(value)) for step, value in expected], name  # the CSV's numbers
    params = run.data.params
    assert params["optim.lr"] == "0.05" and params["train.loggers"] == '["mlflow", "csv"]'
    assert params["model.args.hidden"] == "8" and params["resume"] == "null"
    tags = run.data.tags
    assert tags["ignite_mgpu.processes"] == "1" and tags["ignite_mgpu.gpus"] == "none"
    assert tags["ignite_mgpu.restarts"] == "0" and tags["ignite_mgpu.version"]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]
    assert (out / folder.MLFLOW_ARTIFACTS).is_dir()  # the default store keeps its artifacts in the run folder

    # A restart resumes the same MLflow run: new tags, its parameters kept, a changed one noted.
    tiny_run(out, "train.loggers=[mlflow]", "train.logger_args.mlflow.experiment=tiny", "model.args.hidden=8",
             "resume=auto", "train.epochs=3", epochs=3, resume_at=8, restarts=1)  # fmt: skip
    assert json.loads((out / folder.TRACKER_RUNS).read_text())["mlflow"] == remembered
    run = client.get_run(remembered["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["ignite_mgpu.restarts"] == "1"
    assert run.data.params["train.epochs"] == "2"
    assert "train.epochs: 2 -> 3" in run.data.tags["ignite_mgpu.changed_on_resume"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [1, 2, 3]


def wandb_records(path: Path):
    """The records of W&B's run file (``run-<id>.wandb``, LevelDB's log format of 32 KiB blocks holding
    ``wandb_internal_pb2.Record`` protos); wandb no longer ships a Python reader for it."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, part = path.read_bytes(), 7, b""  # 7 bytes of file header (":W&B", magic, version)
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])  # checksum, length, full/first/middle/last
        chunk, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        part += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            yield record
        if kind != 2 and kind != 3:
            part = b""


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # W&B writes "val/accuracy" as the nested key ["val", "accuracy"]


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra (pip install -e '.[wandb]') is not installed")
    for var in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no login
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")  # no system-metrics sampler
    for var, name in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / name))  # nothing written into $HOME


def test_wandb_offline_writes_the_history_config_and_files(tmp_path, wandb_offline):
    out = tmp_path / "run"
    tiny_run(out, "train.loggers=[wandb,csv]", "train.logger_args.wandb.project=tiny")
    run_id = json.loads((out / folder.TRACKER_RUNS).read_text())["wandb"]["id"]
    (run_file,) = (out / folder.WANDB).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = list(wandb_records(run_file))
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "exit" in kinds and [r.exit.exit_code for r in records if r.HasField("exit")] == [0]
    (run,) = [r.run for r in records if r.HasField("run")]
    assert run.project == "tiny" and run.display_name == "run"
    config = {item_key(i): json.loads(i.value_json) for i in run.config.update}
    config |= {item_key(i): json.loads(i.value_json) for r in records if r.HasField("config") for i in r.config.update}
    assert (
        config["optim.lr"] == "0.05" and config["ignite_mgpu.processes"] == 1 and config["ignite_mgpu.gpus"] == "none"
    )
    history = [
        {item_key(i): json.loads(i.value_json) for i in r.history.item} for r in records if r.HasField("history")
    ]
    rows = csv_rows(out)
    assert [(h["_step"], h["train/loss"]) for h in history] == [
        (i, pytest.approx(v)) for i, v in values(rows, "train/loss")
    ]
    last = history[-1]  # the epoch's numbers at the trainer's iteration, with the epoch beside them
    assert last["_step"] == 8 and last["epoch"] == 2 and "val/accuracy" in last and "samples_per_s" in last
    saved = [f.path for r in records if r.HasField("files") for f in r.files.files]
    assert "config.yaml" in saved


def test_wandb_online_without_credentials_does_not_start_or_prompt(tmp_path, wandb_offline, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with caplog.at_level(logging.WARNING, logger="ignite_mgpu"):
        trainer, _ = tiny_run(tmp_path / "run", "train.loggers=[wandb]")
    assert trainer.state.epoch == 2
    assert "the wandb tracker did not start (RuntimeError: W&B has no API key" in caplog.text


def test_tensorboard_gets_the_same_names(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    tiny_run(out, "train.tensorboard=true")  # the old switch: the tensorboard tracker
    acc = EventAccumulator(str(out / folder.TENSORBOARD))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "val/accuracy", "val/top2", "train_loss", "memory/rank0"} <= scalars
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8]
    assert [e.step for e in acc.Scalars("samples_per_s")] == [1, 2]  # per epoch, as before train.loggers
    assert {"config", "run"} <= {tag.split("/")[0] for tag in acc.Tags()["tensors"]}


def test_a_tracker_that_raises_is_one_warning_and_the_training_goes_on(tmp_path, monkeypatch, caplog):
    real_log = CsvLogger.log

    def broken(self, kind, numbers):
        if kind == "val":
            raise OSError("No space left on device")
        real_log(self, kind, numbers)

    monkeypatch.setattr(CsvLogger, "log", broken)
    with caplog.at_level(logging.WARNING, logger="ignite_mgpu"):
        trainer, _ = tiny_run(tmp_path / "run", "train.loggers=[csv]", epochs=3)
    assert trainer.state.epoch == 3
    warnings = [r.getMessage() for r in caplog.records if "train.loggers" in r.getMessage()]
    assert warnings == [
        "train.loggers: the csv tracker failed to log (OSError: No space left on device); training goes on without it."
    ]
    assert [i for i, _ in values(csv_rows(tmp_path / "run"), "train/loss")] == [2, 4]  # nothing after it failed


def test_trackers_that_cannot_start_are_warnings(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mlflow", reason="the mlflow extra (pip install -e '.[mlflow]') is not installed")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the port refuses at once: no retries to wait for
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with caplog.at_level(logging.WARNING, logger="ignite_mgpu"):
        trainer, _ = tiny_run(
            tmp_path / "run", "train.loggers=[mlflow,csv]", "train.logger_args.mlflow.tracking_uri=http://127.0.0.1:9"
        )
    assert trainer.state.epoch == 2 and values(csv_rows(tmp_path / "run"), "train/loss")
    assert "train.loggers: the mlflow tracker did not start (MlflowException: " in caplog.text
    assert "training goes on without it." in caplog.text
    assert not (tmp_path / "run" / folder.TRACKER_RUNS).exists()  # nothing for a restart to continue


def test_no_trackers_attach_nothing(tmp_path):
    trainer, evaluator = tiny_run(tmp_path / "run")
    assert not (tmp_path / "run" / folder.TRACKER_RUNS).exists()
    assert not (tmp_path / "run" / folder.TRACKING_CSV).exists()


def test_an_mlflow_store_that_fails_later_is_one_warning(tmp_path, monkeypatch, caplog, mlflow_store):
    from mlflow import MlflowClient

    real_log_batch, calls = MlflowClient.log_batch, []

    def failing(self, run_id, metrics=(), *args, **kwargs):  # the server goes away after the run started
        calls.append(run_id)
        if len(calls) > 3:
            raise ConnectionError("the server went away")
        return real_log_batch(self, run_id, metrics, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", failing)
    out = with_store(tmp_path / "run", mlflow_store)
    with caplog.at_level(logging.WARNING, logger="ignite_mgpu"):
        trainer, _ = tiny_run(out, "train.loggers=[mlflow,csv]", epochs=3)
    assert trainer.state.epoch == 3 and len(calls) == 4  # nothing more was sent after the failure
    warnings = [r.getMessage() for r in caplog.records if "train.loggers" in r.getMessage()]
    # The sender thread's error surfaces at the next request or at the end, whichever comes first after it failed.
    assert len(warnings) == 1 and re.fullmatch(
        r"train.loggers: the mlflow tracker failed to (log|end its run) \(ConnectionError: the server went away\); "
        r"training goes on without it\.",
        warnings[0],
    ), warnings
    assert [i for i, _ in values(csv_rows(out), "train/loss")] == list(range(2, 13, 2))  # the others go on


@pytest.mark.parametrize(
    "error, status",
    [(None, "FINISHED"), (TrainingInterrupted(15, 8), "KILLED"), (TrainingDiverged("NaN"), "FAILED")],
)
def test_each_tracker_run_ends_as_the_training_did(tmp_path, error, status):
    ended = []

    class Recorder:
        name = "recorder"

        def close(self, how):
            ended.append(how)

    trackers = Trackers(load_config(), None, None, None, None, tmp_path)
    trackers.started = [Tracker(Recorder())]
    trackers.__exit__(type(error) if error else None, error, None)
    assert ended == [status]
