"""eval.metrics, eval.metric_args, checkpoint.metric and checkpoint.metric_mode as the config checks them (torch-free,
before anything starts), and which way each metric is better. `python -m pytest tests/runs/test_metric_names.py`."""

import pytest

from ignite_mgpu.config.loading import load_config
from ignite_mgpu.config.schema import best_metric
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs import metric_names


def test_names_and_directions():
    assert [metric_names.name_of(e) for e in ("top5", "pkg.m:balanced", "pkg.m:Cls.build")] == [
        "top5",
        "balanced",
        "build",
    ]
    assert (
        metric_names.top_k("top12") == 12 and metric_names.top_k("top0") is None and not metric_names.is_built_in("top")
    )
    assert [metric_names.higher_is_better(n) for n in ("accuracy", "top3", "f1", "loss", "perplexity")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert metric_names.higher_is_better("mine", "max") and not metric_names.higher_is_better("mine", "min")
    assert metric_names.ranked("loss", -0.5) == metric_names.ranked("loss", 0.5) == -0.5  # old names: loss negated
    assert metric_names.ranked("mine", -3.0, "min") == 3.0


def test_defaults_follow_the_loss_as_before():
    assert metric_names.reported(None, "cross_entropy") == ["loss", "accuracy"]
    assert metric_names.reported(None, "model") == ["loss"]
    assert (
        best_metric(load_config()) == "accuracy" and best_metric(load_config(overrides=["train.loss=model"])) == "loss"
    )
    cfg = load_config(overrides=["eval.metrics=[top5,loss]"])
    assert metric_names.reported(cfg.eval.metrics, "cross_entropy") == ["loss", "top5"] and best_metric(cfg) == "loss"
    cfg = load_config(overrides=["eval.metrics=[f1,accuracy]", "checkpoint.metric=f1"])
    assert best_metric(cfg) == "f1" and cfg.checkpoint.metric_mode == "auto"


def test_a_metric_of_the_users_with_its_direction_and_args():
    cfg = load_config(
        overrides=[
            "eval.metrics=[perplexity,tests.plugins_pkg.factories:samples]",
            "eval.metric_args.samples.scale=2",
            "eval.metric_args.perplexity.shift=true",
            "checkpoint.metric=samples",
            "checkpoint.metric_mode=min",
            "train.loss=model",
        ]
    )
    assert cfg.eval.metric_args == {"samples": {"scale": 2}, "perplexity": {"shift": True}}
    assert best_metric(cfg) == "samples"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["eval.metrics=[top_5]"], "eval.metrics entry 'top_5' is not a metric: use loss, accuracy, top<k>"),
        (["eval.metrics=[top0]"], "eval.metrics entry 'top0' is not a metric"),
        (["eval.metrics=['pkg:']"], "eval.metrics entry 'pkg:' is not of the form package.module:factory"),
        (["eval.metrics=[top5]", "train.loss=model"], "eval.metrics entry top5 reads class scores"),
        (["eval.metrics=[f1]", "train.loss=a.b:c"], "eval.metrics entry f1 reads class scores"),
        (["eval.metrics=[perplexity]", "train.loss=a.b:c"], "eval.metrics entry perplexity is exp of the mean loss"),
        (["eval.metrics=[f1,f1]"], "eval.metrics reports f1 twice"),
        (["eval.metrics=[a.b:mine,c.d:mine]"], "eval.metrics reports mine twice"),
        (["eval.metrics=[a.b:loss]"], "eval.metrics entry a.b:loss would report under loss, the name of a built-in"),
        (["eval.metrics=[a.b:top5]"], "eval.metrics entry a.b:top5 would report under top5"),
        (["eval.metrics=[f1]", "eval.metric_args.top5.k=5"], "eval.metric_args.top5: top5 is not among the metrics"),
        (["eval.metrics=[f1]", "eval.metric_args.f1.average=micro"], "eval.metric_args.f1 gives average, but the"),
        (
            ["eval.metrics=[perplexity]", "eval.metric_args.perplexity.shift=1"],
            "eval.metric_args.perplexity.shift = 1 is invalid",
        ),
        (["checkpoint.metric=top5"], r"checkpoint.metric=top5 is not among the validation metrics (loss, accuracy)"),
        (["eval.metrics=[f1]", "checkpoint.metric=accuracy"], "Add it to eval.metrics (eval.metrics=[f1,accuracy])"),
        (["checkpoint.metric=accuracy", "train.loss=model"], "checkpoint.metric=accuracy needs classification"),
        (["checkpoint.metric=top5", "train.loss=model"], "checkpoint.metric=top5 needs classification"),
        (["checkpoint.metric_mode=min"], "checkpoint.metric_mode=min contradicts checkpoint.metric=accuracy, whose hi"),
        (["checkpoint.metric=loss", "checkpoint.metric_mode=max"], "contradicts checkpoint.metric=loss, whose lower"),
        (
            ["eval.metrics=[a.b:mine]", "checkpoint.metric=mine"],
            "checkpoint.metric=mine is a metric of your own, and which way it is better is not known",
        ),
        (["checkpoint.metric_mode=up"], "checkpoint.metric_mode"),
    ],
)
def test_bad_metrics_are_refused_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(overrides=overrides)
