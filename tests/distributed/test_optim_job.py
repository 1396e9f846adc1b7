"""The optimizers how-to's recipe on 2 real gloo processes, as a user runs it (issue #29's "done when"): one YAML file
trains with Adam, OneCycleLR over the run's optimizer steps, biases without weight decay and label smoothing, picks
the best model by top-5 accuracy, and is tracked by MLflow (read back with its client) and a CSV file.
`python -m pytest tests/distributed/test_optim_job.py -q`."""

import csv
import json
import shutil

import pytest
import torch

from ignite_mgpu.checkpoint.files import list_checkpoints, read_checkpoint
from ignite_mgpu.runs import folder
from tests.docs_blocks import doc_block, run_block, sandbox

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_the_optimizers_how_to_recipe_trains_on_two_processes_and_mlflow_reads_it_back(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    run = sandbox(tmp_path) / "runs" / "adam_onecycle"
    run.mkdir(parents=True)
    shutil.copy(mlflow_store, run / folder.MLFLOW_DB)  # the store the run would create, made once per session
    result = run_block(doc_block("optimizers"), tmp_path, timeout=220)
    assert "train.loggers" not in result.stderr  # no tracker failed
    rows = [json.loads(line) for line in (run / folder.METRICS).read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2] and all("val_top5" in row for row in rows)

    checkpoint = read_checkpoint(list_checkpoints(run)[0])  # weights_only: the schedule's state is plain data
    assert checkpoint["run"]["world_size"] == 2 and checkpoint["trainer"]["iteration"] == 16  # 8 steps an epoch
    assert checkpoint["lr_scheduler"]["total_steps"] == checkpoint["lr_scheduler"]["last_epoch"] == 16
    groups = checkpoint["optimizer"]["param_groups"]
    assert [(len(g["params"]), g["weight_decay"], g["betas"][1]) for g in groups] == [(3, 1e-4, 0.99), (3, 0.0, 0.99)]
    assert "label_smoothing: 0.1" in (run / "config.yaml").read_text()

    top5 = [row["val_top5"] for row in rows]
    epoch = top5.index(max(top5)) + 1  # a tie keeps the earlier model
    (best,) = run.glob("best_model_*")
    assert best.name == f"best_model_{epoch}_val_top5={max(top5):.4f}.pt"
    final = read_checkpoint(run / "checkpoint_16.pt")["model"]
    if epoch == 2:
        assert all(torch.equal(v, final[k]) for k, v in torch.load(best, weights_only=True).items())

    remembered = json.loads((run / folder.TRACKER_RUNS).read_text())["mlflow"]
    client = MlflowClient(remembered["tracking_uri"])
    mlflow_run = client.get_run(remembered["run_id"])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["optim.scheduler"] == "OneCycleLR"
    for name in ("top5", "accuracy", "loss"):
        history = client.get_metric_history(remembered["run_id"], f"val/{name}")
        assert [(m.step, m.value) for m in history] == [(r["epoch"], pytest.approx(r[f"val_{name}"])) for r in rows]
    rates = client.get_metric_history(remembered["run_id"], "train/lr/0")
    assert [m.step for m in rates] == [4, 8, 12, 16] and max(m.value for m in rates) <= 0.003  # max_lr: optim.lr

    with (run / folder.TRACKING_CSV).open(newline="") as f:
        logged = {
            (r["kind"], r["epoch"], r["name"]): float(r["value"]) for r in csv.DictReader(f) if r["kind"] == "val"
        }
    assert logged[("val", "2", "val/top5")] == pytest.approx(rows[1]["val_top5"])
