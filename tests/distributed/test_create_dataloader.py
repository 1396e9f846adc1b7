"""create_dataloader on 2 real gloo processes, in one spawned job: the global batch split over the processes (and
refused when it does not divide), a new seeded order every epoch, and validation that scores every sample exactly
once, also when the samples do not divide. `python -m pytest tests/distributed/test_create_dataloader.py -q`."""

from __future__ import annotations

import json
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch
from ignite.engine import Events
from torch import nn
from torch.utils.data import TensorDataset

from ignite_mgpu import ConfigError, create_dataloader, create_evaluator, create_trainer, launch, validation_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class FirstClass(nn.Module):
    """Predicts class 0 for every sample: its accuracy over n labels 0..n-1, each scored once, is exactly 1/n."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.classes = classes
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(x), self.classes)
        logits[:, 0] = 1.0
        return logits * self.scale


def indexed(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))


def _job(local_rank: int, out: Path) -> None:
    rank, report = idist.get_rank(), {}
    for n in (1000, 999):  # 999 over 2: a padding sampler would score sample 0 twice
        loader = create_dataloader(indexed(n), 64, train=False)
        report[f"val_{n}"] = [int(i) for _, y in loader for i in y]
        evaluator = create_evaluator(FirstClass(n), validation_metrics(nn.CrossEntropyLoss(), idist.device()))
        report[f"accuracy_{n}"] = evaluator.run(loader).metrics["accuracy"]

    train = indexed(256)
    loader = create_dataloader(train, 64, train=True, seed=3)
    report["per_process_batch"] = len(next(iter(loader))[1])
    seen: dict[int, list[int]] = {}
    model = nn.Linear(1, 256)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss())

    @trainer.on(Events.ITERATION_COMPLETED)
    def record(engine):
        seen.setdefault(engine.state.epoch, []).extend(int(i) for i in engine.state.batch[1])

    trainer.run(loader, max_epochs=2)  # the trainer sets the sampler's epoch: two different orders
    report["train_epochs"] = seen
    try:
        create_dataloader(train, 1)
    except ConfigError as err:
        report["odd_batch"] = str(err)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.timeout(120)
def test_create_dataloader_splits_the_global_batch_and_scores_every_validation_sample_once(tmp_path):
    launch(_job, tmp_path, nproc=2, backend="gloo")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for n in (1000, 999):
        shards = [set(r[f"val_{n}"]) for r in ranks]
        assert sum(len(r[f"val_{n}"]) for r in ranks) == n  # nothing padded, nothing left out
        assert shards[0] | shards[1] == set(range(n)) and not shards[0] & shards[1]
        assert all(r[f"accuracy_{n}"] == pytest.approx(1 / n) for r in ranks)  # reduced over ranks: each once

    assert all(r["per_process_batch"] == 32 for r in ranks)  # 64 is the global batch
    for epoch in ("1", "2"):
        assert sorted(ranks[0]["train_epochs"][epoch] + ranks[1]["train_epochs"][epoch]) == list(range(256))
    assert ranks[0]["train_epochs"]["1"] != ranks[0]["train_epochs"]["2"]  # set_epoch: a new order
    for r in ranks:
        assert "batch_size=1 is the global batch, split over 2 processes: each needs at least" in r["odd_batch"]
        assert "use batch_size=2 or more" in r["odd_batch"]
