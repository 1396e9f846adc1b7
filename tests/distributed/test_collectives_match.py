"""Collectives match on uneven shares (issue #50): FSDP on 3 real gloo processes, a global batch of 64 (22 + 21 + 21,
and the epoch's short last batch of 22: 8 + 7 + 7) in parts of 7. Rank 0 holds 4 parts and the others 3 (2 and 1 in
the last batch); every forward all-gathers, so the ranks with fewer run zero-weight parts until all ran as many, and
the run ends with the weights, losses and scores of whole batches. The validation shards (64: 22 + 21 + 21, in
batches of 21: rank 0 holds two, the second of 1 sample) are evaluated in parts too, 3 on every rank per batch, the
others' repeated last batch included. A model with BatchNorm pads with empty parts instead (FSDP's forward and
backward of 0 samples, for real). One spawned job trains every run.
`python -m pytest tests/distributed/test_collectives_match.py`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ignite_mgpu import launch
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.train.default_job import training
from tests.distributed.test_micro_batch import assert_within, final_model
from tests.helpers import cpu_fsdp

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# An MLP (nothing random, nothing across samples) on 150 synthetic images: global batches of 64, 64 and 22; 1 epoch.
JOB = [
    "model.name=mlp", "data.image_size=8", "data.train_size=150", "data.val_size=64", "data.batch_size=64",
    "train.epochs=1", "train.check_every=1", "train.progress_bar=false", "dist.strategy=fsdp", "optim.name=adamw",
]  # fmt: skip
RUNS = {
    "whole": [],
    "parts": ["train.micro_batch=7"],
    "batchnorm": ["model.name=tests.plugins_pkg.factories:bn_cnn", "train.micro_batch=7"],
}


def every_run(local_rank: int, root: str) -> None:
    for name, extra in RUNS.items():
        training(local_rank, load_config(overrides=[*JOB, f"output_dir={root}/{name}", *extra]))


def scores(out: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: row[k] for k in ("train_loss", "val_loss", "val_accuracy")} for row in rows]


@cpu_fsdp
# Before the fix the first step deadlocked (rank 0 in an all-gather, ranks 1 and 2 in a reduce-scatter).
@pytest.mark.timeout(150)
def test_fsdp_in_parts_over_uneven_shares_trains_and_evaluates_like_whole_batches(tmp_path):
    launch(every_run, str(tmp_path), nproc=3, backend="gloo")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert_within(final_model(parts), final_model(whole), atol=1e-5)
    for a, b in zip(scores(parts), scores(whole), strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    # Its parts are of 7 on rank 0 and padded on ranks 1 and 2 (no reference: BatchNorm's statistics are each part's).
    assert all(math.isfinite(v) for row in scores(tmp_path / "batchnorm") for v in row.values())
