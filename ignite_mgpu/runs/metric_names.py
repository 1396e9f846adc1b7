"""The validation metrics by name (``eval.metrics``): the built-in names, what each needs of ``train.loss``, which way
each is better, and the names a run reports. Torch-free, a leaf: the config's checks and the best model's ranking
(``checkpoint/save.py``, ``runs/read.py``) read it; ``train/metrics.py`` builds the metrics."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ignite_mgpu.errors import ConfigError

# And top<k>: they read class scores (cross_entropy)
CLASSIFICATION = ("accuracy", "precision", "recall", "f1")
LOWER_IS_BETTER = ("loss", "perplexity")  # every other built-in: higher is better
# The built-ins, with top<k>.
NAMES = ("loss", "accuracy", "perplexity", "precision", "recall", "f1")
# The built-ins that take eval.metric_args.<name>, and their keys.
METRIC_ARGS = {"perplexity": ("shift",)}
TOP_K = re.compile(r"top([1-9][0-9]*)")  # top5: the target is among the 5 highest scores
# package.module:factory (the factory may be dotted)
FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
CHOICES = (
    "use loss, accuracy, top<k> (top5: the target among the 5 highest scores), perplexity, precision, recall or f1 "
    "(macro averages over the classes), or 'package.module:factory' for a factory that returns an ignite Metric"
)


def top_k(name: str) -> int | None:
    """k of ``top<k>``, None for any other name."""
    found = TOP_K.fullmatch(name)
    return int(found[1]) if found else None


def is_built_in(name: str) -> bool:
    return name in NAMES or top_k(name) is not None


def needs_class_scores(name: str) -> bool:
    return name in CLASSIFICATION or top_k(name) is not None


def name_of(entry: str) -> str:
    """The name an ``eval.metrics`` entry reports under (``val_<name>``, ``checkpoint.metric``): a built-in's own,
    a factory's last name (``mypkg.metrics:balanced_accuracy`` -> ``balanced_accuracy``)."""
    return entry.partition(":")[2].rpartition(".")[2] if ":" in entry else entry


def reported(entries: Sequence[str] | None, loss: str) -> list[str]:
    """The names the evaluator reports for ``eval.metrics`` and ``train.loss``: without entries, loss (and accuracy
    with cross_entropy); else the loss first, always, then every entry's name."""
    if entries is None:
        return ["loss", "accuracy"] if loss == "cross_entropy" else ["loss"]
    return ["loss", *(n for n in map(name_of, entries) if n != "loss")]


def higher_is_better(name: str, mode: str = "auto") -> bool:
    """Which way ``name`` is better: a built-in's own direction; another name's from ``mode`` (max, min; auto:
    higher, as ignite ranks scores)."""
    if is_built_in(name):
        return name not in LOWER_IS_BETTER
    return mode != "min"


def ranked(name: str, value: float, mode: str = "auto") -> float:
    """A score where higher is better for ``name``'s ``value`` (as reported, or as a best model's file name holds
    it: a loss used to be written negated, so a loss's sign is ignored)."""
    if higher_is_better(name, mode):
        return value
    return -abs(value) if name == "loss" else -value


def default_best(names: Sequence[str]) -> str:
    """The metric that picks the best model without ``checkpoint.metric``: accuracy where it is reported, else the
    loss."""
    return "accuracy" if "accuracy" in names else "loss"


def check(entries: Sequence[str] | None, args: Mapping[str, Any], loss: str, best: str | None, mode: str) -> None:
    """ConfigError for ``eval.metrics`` / ``eval.metric_args`` / ``checkpoint.metric`` / ``checkpoint.metric_mode``
    that do not exist or do not go with ``train.loss``. The factories' imports are the pre-flight's."""
    entries = list(entries) if entries is not None else None
    for entry in entries or ():
        _check_entry(entry, loss)
    given = [name_of(e) for e in entries or ()]
    twice = sorted({n for n in given if given.count(n) > 1})
    if twice:
        raise ConfigError(
            f"eval.metrics reports {', '.join(twice)} twice ({', '.join(entries or ())}): every metric is reported "
            "as val_<name>, a factory under its own name. Drop the repeated entry, or give a factory another name "
            "(a function of that name that returns the metric)."
        )
    names = reported(entries, loss)
    _check_args(args, entries or (), names)
    _check_best(best, mode, entries, names, loss)


def _check_entry(entry: str, loss: str) -> None:
    if ":" in entry:
        if not FACTORY.fullmatch(entry):
            raise ConfigError(f"eval.metrics entry {entry!r} is not of the form package.module:factory; {CHOICES}.")
        if is_built_in(name_of(entry)):
            raise ConfigError(
                f"eval.metrics entry {entry} would report under {name_of(entry)}, the name of a built-in metric (its "
                "direction and its needs are the built-in's). Name the factory otherwise (a function of another "
                "name that returns the metric), or use the built-in."
            )
        return
    if not is_built_in(entry):
        raise ConfigError(f"eval.metrics entry {entry!r} is not a metric: {CHOICES}.")
    if needs_class_scores(entry) and loss != "cross_entropy":
        raise ConfigError(
            f"eval.metrics entry {entry} reads class scores (train.loss=cross_entropy), but train.loss={loss}: the "
            "evaluator then gives no class scores to compare with the targets. Drop it, or name a metric of your "
            "own (package.module:factory) that takes what the evaluator gives: (predictions, targets) for a loss "
            "function, (mean loss, batch size) for train.loss=model."
        )
    if entry == "perplexity" and loss not in ("cross_entropy", "model"):
        raise ConfigError(
            f"eval.metrics entry perplexity is exp of the mean loss per token, which needs a loss whose tokens it "
            f"can count: train.loss=cross_entropy (computed from the predictions and targets, label -100 ignored) "
            f"or train.loss=model (the model's mean loss per token, weighted by the labels of each batch). "
            f"train.loss={loss} is a function of your own: name a metric of your own (package.module:factory)."
        )


def _check_args(args: Mapping[str, Any], entries: Sequence[str], names: list[str]) -> None:
    factories = {name_of(e) for e in entries if ":" in e}
    for name, given in args.items():
        if name not in names or name == "loss":
            raise ConfigError(
                f"eval.metric_args.{name}: {name} is not among the metrics of eval.metrics ({', '.join(names)}); "
                "the arguments are keyed by the metric's name. Fix the name, or add the metric to eval.metrics."
            )
        if name in factories:
            # A factory's own parameters: checked against its signature before anything starts.
            continue
        unknown = sorted(set(given) - set(METRIC_ARGS.get(name, ())))
        if unknown:
            takes = ", ".join(METRIC_ARGS.get(name, ())) or "nothing"
            raise ConfigError(
                f"eval.metric_args.{name} gives {', '.join(unknown)}, but the built-in {name} takes {takes}. "
                "Remove the argument, or name a factory of your own that takes it."
            )
        if name == "perplexity" and not isinstance(given.get("shift", False), bool):
            raise ConfigError(
                f"eval.metric_args.perplexity.shift = {given['shift']!r} is invalid: use true for a model that "
                "shifts its labels inside (Hugging Face causal LMs: the first label of each row is not predicted), "
                "false (the default) for labels aligned with the predictions."
            )


def _check_best(best: str | None, mode: str, entries: Sequence[str] | None, names: list[str], loss: str) -> None:
    if best is not None and entries is None and needs_class_scores(best) and loss != "cross_entropy":
        raise ConfigError(
            f"checkpoint.metric={best} needs classification (train.loss=cross_entropy), but train.loss={loss} "
            "reports only the validation loss. Use checkpoint.metric=loss, or leave it out (it follows train.loss)."
        )
    if best is not None and best not in names:
        add = f"eval.metrics=[{','.join([*(entries if entries is not None else names), best])}]"
        raise ConfigError(
            f"checkpoint.metric={best} is not among the validation metrics ({', '.join(names)}): the best model is "
            f"picked by a metric the evaluator reports. Add it to eval.metrics ({add}), or choose one of them."
        )
    best = best or default_best(names)
    if is_built_in(best) and mode != "auto" and (mode == "max") != higher_is_better(best):
        better = "higher" if higher_is_better(best) else "lower"
        raise ConfigError(
            f"checkpoint.metric_mode={mode} contradicts checkpoint.metric={best}, whose {better} values are better. "
            "Leave checkpoint.metric_mode at auto for the built-in metrics."
        )
    if not is_built_in(best) and mode == "auto":
        raise ConfigError(
            f"checkpoint.metric={best} is a metric of your own, and which way it is better is not known: set "
            "checkpoint.metric_mode=max (higher is better) or checkpoint.metric_mode=min (lower is better)."
        )
