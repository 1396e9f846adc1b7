"""The how-to's tracked run (docs/how-to/track-experiments.md): `ignite-mgpu train configs/tracking.yaml` on 2
gloo processes with MLflow and the CSV file, read back by the page's own Python block; only rank 0 logs.
`python -m pytest tests/distributed/test_tracking.py`."""

import csv
import json
import shutil
from collections import Counter

import pytest

from ignite_mgpu.runs import folder
from tests.docs_blocks import doc_block, run_block, sandbox

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_the_how_to_tracks_a_two_process_run_with_mlflow_and_csv(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    run_dir = sandbox(tmp_path) / "runs" / "tracking"
    run_dir.mkdir(parents=True)
    shutil.copy(mlflow_store, run_dir / folder.MLFLOW_DB)  # the store the run would create, made once per session
    trained = run_block(doc_block("track-experiments"), tmp_path, timeout=220)
    assert "train.loggers" not in trained.stderr  # no tracker failed
    printed = run_block(doc_block("track-experiments-read"), tmp_path, timeout=60).stdout.splitlines()
    assert printed[1].startswith("2 none ")  # processes, GPUs, git commit

    remembered = json.loads((run_dir / folder.TRACKER_RUNS).read_text())["mlflow"]
    client = MlflowClient(remembered["tracking_uri"])
    (experiment,) = [e for e in client.search_experiments() if e.name == "debug"]
    (run,) = client.search_runs([experiment.experiment_id])  # one run: rank 1 started none
    assert run.info.run_id == remembered["run_id"] and run.info.status == "FINISHED"
    epochs = [json.loads(line) for line in (run_dir / folder.METRICS).read_text().splitlines()]
    accuracy = client.get_metric_history(run.info.run_id, "val/accuracy")
    assert [(m.step, m.value) for m in accuracy] == [(e["epoch"], pytest.approx(e["val_accuracy"])) for e in epochs]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4, 6, 8]  # 4 per epoch
    memory = client.get_metric_history(run.info.run_id, "memory/rank1")  # rank 1's memory, logged by rank 0
    assert [m.value for m in memory] == [e["peak_memory_mb"][1] for e in epochs]
    assert run.data.params["dist.nproc"] == "2" and run.data.tags["ignite_mgpu.processes"] == "2"

    with (run_dir / folder.TRACKING_CSV).open(newline="") as f:
        rows = list(csv.DictReader(f))
    once = Counter((r["kind"], r["iteration"], r["name"]) for r in rows)
    assert set(once.values()) == {1}  # each number written once: by rank 0 alone
    assert str(epochs[-1]["val_loss"]) in {r["value"] for r in rows if r["name"] == "val/loss"}
