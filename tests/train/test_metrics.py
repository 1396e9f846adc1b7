"""The metrics of eval.metrics in one process: each built-in against its definition written out here, perplexity over
tokens (labels -100 ignored, shifted labels), the user's factories, the epoch log's fields and `evaluate`'s JSON.
Over 2 real processes: tests/distributed/test_metrics.py. `python -m pytest tests/train/test_metrics.py`."""

import json
import math

import pytest
import torch
from ignite.engine import Engine
from torch import nn
from torch.utils.data import DataLoader

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train.evaluator import create_evaluator, validation_metrics
from ignite_mgpu.train.metrics import Perplexity, token_count

CPU = torch.device("cpu")
CLASSIFICATION = ["accuracy", "top5", "top2", "precision", "recall", "f1", "perplexity"]


def expected_metrics(logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Every built-in classification metric of eval.metrics, from its definition: precision, recall and f1 are
    macro averages over all the model's classes (a class never predicted, or never present, counts 0)."""
    logits, classes = logits.double(), logits.shape[1]
    predicted = logits.argmax(1)
    per_class = []
    for c in range(classes):
        tp = ((predicted == c) & (y == c)).sum().item()
        p = tp / max((predicted == c).sum().item(), 1)
        r = tp / max((y == c).sum().item(), 1)
        per_class.append((p, r, 2 * p * r / (p + r) if p + r else 0.0))
    ce = nn.functional.cross_entropy(logits, y).item()
    in_top = lambda k: (logits.topk(k, 1).indices == y[:, None]).any(1).double().mean().item()  # noqa: E731
    return {
        "loss": ce,
        "accuracy": (predicted == y).double().mean().item(),
        "top5": in_top(5),
        "top2": in_top(2),
        "precision": sum(p for p, _, _ in per_class) / classes,
        "recall": sum(r for _, r, _ in per_class) / classes,
        "f1": sum(f for _, _, f in per_class) / classes,
        "perplexity": math.exp(ce),
    }


def scored(outputs, metrics):
    """Run an evaluator-like Engine whose outputs are ``outputs`` through ``metrics``."""
    engine = Engine(lambda e, batch: batch)
    for name, metric in metrics.items():
        metric.attach(engine, name)
    return engine.run(outputs).metrics


def test_each_classification_metric_is_its_definition_over_uneven_batches():
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(23, 7, generator=g), torch.randint(0, 6, (23,), generator=g)  # class 6 never a target
    logits[:, 5] -= 5  # and class 5 hardly ever predicted
    batches = [(logits[a:b], y[a:b]) for a, b in ((0, 8), (8, 16), (16, 23))]
    found = scored(batches, validation_metrics(nn.CrossEntropyLoss(), CPU, CLASSIFICATION))
    assert list(found) == ["loss", *CLASSIFICATION]  # the loss always, first
    for name, value in expected_metrics(logits, y).items():
        assert found[name] == pytest.approx(value, abs=1e-6), name


def test_without_eval_metrics_the_default_metrics_are_kept():
    assert list(validation_metrics(nn.CrossEntropyLoss(), CPU)) == ["loss", "accuracy"]
    assert list(validation_metrics(nn.CrossEntropyLoss(), CPU, [])) == ["loss"]
    assert list(validation_metrics(None, CPU, ["loss", "perplexity"])) == ["loss", "perplexity"]


def test_top_k_with_fewer_classes_says_which_key():
    with pytest.raises(ValueError, match=r"eval.metrics entry top5 needs at least 5 class scores, but the model "):
        metrics = validation_metrics(nn.CrossEntropyLoss(), CPU, ["top5"])
        scored([(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))], metrics)


class TinyLM(nn.Module):
    """Computes its mean loss per token, labels -100 ignored; ``shift``: predicts label t + 1 at position t, as a
    Hugging Face causal LM does with labels equal to its inputs."""

    def __init__(self, shift: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head, self.shift = nn.Embedding(11, 8), nn.Linear(8, 11), shift

    def token_losses(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        losses = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return losses[labels.flatten() != -100]

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        return SimpleNamespace(loss=self.token_losses(input_ids, labels).mean())


def lm_items(n: int = 7, length: int = 6) -> list[dict]:
    """Sequences whose labels are their inputs, each with another number of -100 (padding) at its end."""
    g = torch.Generator().manual_seed(1)
    items = []
    for i in range(n):
        ids = torch.randint(0, 11, (length,), generator=g)
        labels = ids.clone()
        labels[length - i % 4 :] = -100
        items.append({"input_ids": ids, "labels": labels})
    return items


@pytest.mark.parametrize("shift", [False, True])
def test_perplexity_of_a_model_loss_weights_each_batch_by_its_tokens(shift):
    model, items = TinyLM(shift), lm_items()
    metrics = validation_metrics(None, CPU, ["perplexity"], {"perplexity": {"shift": shift}})
    state = create_evaluator(model, metrics, model_loss=True, device="cpu").run(DataLoader(items, batch_size=3))
    batch = {k: torch.stack([i[k] for i in items]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        every = model.token_losses(batch["input_ids"], batch["labels"])
    assert len(every) == token_count(batch, shift)
    assert state.metrics["perplexity"] == pytest.approx(math.exp(every.double().mean().item()), rel=1e-6)
    # the loss is a mean over samples: with uneven tokens per sample it is not the mean over tokens
    assert state.metrics["loss"] != pytest.approx(every.mean().item(), rel=1e-4)


def test_perplexity_shards_reduce_to_the_whole():
    """What the all-reduce does (tests/distributed runs it): the summed losses and tokens of two uneven shards."""
    model, items = TinyLM(True), lm_items()
    parts = []
    for shard in (items[0::2], items[1::2], items):
        metric = Perplexity(model_loss=True, shift=True)
        create_evaluator(model, {"ppl": metric}, model_loss=True, device="cpu").run(DataLoader(shard, batch_size=2))
        parts.append(metric)
    whole = Perplexity()
    whole._sum, whole._tokens = parts[0]._sum + parts[1]._sum, parts[0]._tokens + parts[1]._tokens
    assert whole.compute() == pytest.approx(parts[2].compute(), rel=1e-6)  # float32 means of other batches


FACTORY = "tests.plugins_pkg.factories"


def test_a_factory_metric_gets_its_args_and_the_device():
    args = {"samples": {"scale": 3}, "Precision": {"average": "weighted"}}
    metrics = validation_metrics(nn.CrossEntropyLoss(), CPU, [f"{FACTORY}:samples", "ignite.metrics:Precision"], args)
    assert list(metrics) == ["loss", "samples", "Precision"] and metrics["samples"].given_device == CPU
    logits, y = torch.eye(4)[[0, 1, 1, 3]], torch.tensor([0, 1, 2, 3])
    found = scored([(logits[:3], y[:3]), (logits[3:], y[3:])], metrics)
    assert found["samples"] == 12 and found["Precision"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)


@pytest.mark.parametrize(
    "entry, args, message",
    [
        (f"{FACTORY}:not_a_metric", {}, f"eval.metrics entry {FACTORY}:not_a_metric returned a float; a metric"),
        (f"{FACTORY}:samples", {"scael": 2}, "eval.metric_args.samples gives scael, which"),
        (f"{FACTORY}:nothing", {}, f"eval.metrics={FACTORY}:nothing: module '{FACTORY}' has no attribute"),
    ],
)
def test_factory_mistakes_name_the_key(entry, args, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validation_metrics(None, CPU, [entry], {entry.rpartition(":")[2]: args})


def test_the_epoch_log_writes_every_metric_after_the_loss():
    from ignite_mgpu.train.epoch_log import validation_fields

    found = validation_fields({"accuracy": 0.5, "loss": 2.0, "top5": 0.9, "per_class": torch.tensor([0.1, 0.2])})
    assert list(found) == ["val_loss", "val_accuracy", "val_top5", "val_per_class"]
    assert found["val_per_class"] == pytest.approx([0.1, 0.2]) and validation_fields({})["val_loss"] != 0  # NaN


def test_evaluate_reports_the_configured_metrics(tmp_path, monkeypatch, capsys):
    from ignite_mgpu.config.loading import load_config
    from ignite_mgpu.train import default_job
    from ignite_mgpu.train.models import create_model

    cfg = load_config(None, ["data.val_size=9", "eval.metrics=[top3,f1]", "train.keep_cpu_memory=false"])
    torch.save(create_model(cfg.model, torch.zeros(1, 3, 32, 32)).state_dict(), tmp_path / "weights.pt")
    monkeypatch.setattr(default_job, "setup_logging", lambda rank: None)  # leave pytest's logging alone
    default_job.scoring(0, cfg, str(tmp_path / "weights.pt"), True)
    result = json.loads(capsys.readouterr().out)
    assert list(result) == ["checkpoint", "samples", "loss", "top3", "f1"] and result["samples"] == 9
