"""eval.metrics over 2 real gloo processes, in one job: the how-to's commands (docs/how-to/metrics.md) train
configs/metrics.yaml and report it; every metric of every epoch equals one process scoring the 101 validation
samples (51 + 50 on the two ranks), and top-5 accuracy picks the best model.
`python -m pytest tests/distributed/test_metrics.py`."""

from __future__ import annotations

import json

import pytest
import torch

from ignite_mgpu.checkpoint.files import read_checkpoint
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.train.data.datasets import build_datasets
from ignite_mgpu.train.models import create_model
from tests.conftest import REPO
from tests.docs_blocks import doc_block, run_block, sandbox
from tests.train.test_metrics import expected_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def weighted_precision(logits: torch.Tensor, y: torch.Tensor) -> float:
    """ignite's Precision(average="weighted"): each class's precision weighted by its number of targets."""
    predicted = logits.argmax(1)
    total = 0.0
    for c in range(logits.shape[1]):
        precision = ((predicted == c) & (y == c)).sum().item() / max((predicted == c).sum().item(), 1)
        total += precision * (y == c).sum().item()
    return total / len(y)


@pytest.mark.timeout(240)
def test_every_metric_of_a_2_process_run_is_one_process_scoring_every_sample(tmp_path):
    result = run_block(doc_block("metrics"), sandbox(tmp_path), timeout=220)
    out = tmp_path / "runs" / "metrics"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    names = ["loss", "accuracy", "top5", "f1", "precision", "recall", "perplexity", "Precision"]
    assert [r["epoch"] for r in rows] == [1, 2] and [k[4:] for k in rows[0] if k.startswith("val_")] == names

    cfg = load_config(REPO / "configs" / "metrics.yaml")
    val = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed).val
    x, y = torch.stack([val[i][0] for i in range(len(val))]), torch.tensor([val[i][1] for i in range(len(val))])
    assert len(y) == 101
    model = create_model(cfg.model, x[:1])
    for row in rows:  # checkpoint.n_saved=2: each epoch's weights
        model.load_state_dict(read_checkpoint(out / f"checkpoint_{row['iteration']}.pt")["model"])
        with torch.no_grad():
            logits = model(x)
        expected = expected_metrics(logits, y) | {"Precision": weighted_precision(logits, y)}
        for name in names:
            tolerance = {"rel": 1e-6} if name == "perplexity" else {"abs": 1e-6}
            assert row[f"val_{name}"] == pytest.approx(expected[name], **tolerance), (row["epoch"], name)

    top5 = [r["val_top5"] for r in rows]
    epoch = top5.index(max(top5)) + 1  # the first of the best: a tie keeps the earlier model
    (best,) = out.glob("best_model_*.pt")
    assert best.name == f"best_model_{epoch}_val_top5={max(top5):.4f}.pt"
    kept = read_checkpoint(out / f"checkpoint_{rows[epoch - 1]['iteration']}.pt")["model"]
    for key, value in torch.load(best, weights_only=True).items():
        assert torch.equal(value, kept[key]), key

    header = next(line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["epoch"])
    assert header[3:9] == ["val_acc", "val_top5", "val_f1", "val_precision", "val_recall", "val_perplexity"]
    assert header[9] == "val_Precision"
