"""The optimizers how-to's example on 2 real gloo processes, as a user runs it: Adam, OneCycleLR over the run's
optimizer steps, biases without weight decay, label smoothing, in the checkpoint as configured.
`python -m pytest tests/distributed/test_optim_job.py -q`."""

import json

import pytest

from ignite_mgpu.checkpoint.files import list_checkpoints, read_checkpoint
from tests.docs_blocks import doc_block, run_block, sandbox

pytestmark = [pytest.mark.distributed]


@pytest.mark.timeout(200)
def test_the_optimizers_how_to_trains_on_two_processes(tmp_path):
    run_block(doc_block("optimizers"), sandbox(tmp_path), timeout=180)
    run = tmp_path / "runs" / "adam_onecycle"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2]
    checkpoint = read_checkpoint(list_checkpoints(run)[0])  # weights_only: the schedule's state is plain data
    assert checkpoint["run"]["world_size"] == 2 and checkpoint["trainer"]["iteration"] == 16  # 8 steps an epoch
    assert checkpoint["lr_scheduler"]["total_steps"] == checkpoint["lr_scheduler"]["last_epoch"] == 16
    groups = checkpoint["optimizer"]["param_groups"]
    assert [(len(g["params"]), g["weight_decay"], g["betas"][1]) for g in groups] == [(3, 1e-4, 0.99), (3, 0.0, 0.99)]
    assert "label_smoothing: 0.1" in (run / "config.yaml").read_text()
