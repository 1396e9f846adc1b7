"""The validation metrics of ``eval.metrics`` (names in ``runs/metric_names.py``): ignite's metrics, ``Perplexity``
and the user's factories. Each keeps sums (correct counts, per-class counts, summed losses, tokens) that ignite
all-reduces before it divides, so the value over the uneven shards of the validation sampler equals one process
scoring every sample once."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from ignite.engine import Engine
from ignite.metrics import Accuracy, Fbeta, Metric, Precision, Recall, TopKCategoricalAccuracy
from ignite.metrics.metric import reinit__is_reduced, sync_all_reduce

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs import metric_names
from ignite_mgpu.train import plugins
from ignite_mgpu.train.data import batches

# The label of a position that is not predicted (PyTorch's cross_entropy, Hugging Face)
IGNORE_INDEX = -100


class TopK(TopKCategoricalAccuracy):
    """``top<k>``: ignite's top-k accuracy, with a message naming the config key when the model scores fewer than
    k classes (``torch.topk`` would only say "selected index k out of range")."""

    def __init__(self, k: int = 5, **kwargs: Any) -> None:
        super().__init__(k, **kwargs)
        self.k = k  # ignite keeps its own copy private

    def update(self, output: Sequence[torch.Tensor]) -> None:
        if output[0].shape[1] < self.k:
            raise ValueError(
                f"eval.metrics entry top{self.k} needs at least {self.k} class scores, but the model gives "
                f"{output[0].shape[1]}: use a smaller k."
            )
        super().update(output)


class Perplexity(Metric):
    """exp(summed token losses / tokens), both sums all-reduced before the division (not a mean of per-rank
    means): exact over uneven shards.

    With a loss function (``model_loss=False``) the output is ``(predictions, targets)`` as for cross-entropy,
    predictions ``(N, C, ...)``, and every target that is not -100 is a token: the sum is computed here (no label
    smoothing or class weights). With a model that computes its loss (``model_loss=True``) the output is
    ``(mean loss, batch size)`` and the batch's labels count the tokens the model averaged over: every label that
    is not -100, or with ``shift`` (a model that shifts its labels inside: Hugging Face causal LMs) every one but
    the first of each row. Each batch's mean loss is weighted by its tokens, so the value is exact as long as those
    are the tokens the model averaged over.
    """

    def __init__(
        self,
        model_loss: bool = False,
        shift: bool = False,
        output_transform: Callable[[Any], Any] = lambda x: x,
        device: str | torch.device = torch.device("cpu"),
    ) -> None:
        self.model_loss, self.shift = model_loss, shift
        # ignite's copies are private.
        self.transform, self.device = output_transform, torch.device(device)
        super().__init__(output_transform, device=device)

    @reinit__is_reduced
    def reset(self) -> None:
        self._sum = torch.tensor(0.0, dtype=torch.float64, device=self.device)
        self._tokens = torch.tensor(0, dtype=torch.int64, device=self.device)

    def iteration_completed(self, engine: Engine) -> None:
        if not self.model_loss:
            return super().iteration_completed(engine)
        # The labels of the batch as the loader gave it (on the host, usually: counted without a device sync).
        self._add(self.transform(engine.state.output)[0], token_count(engine.state.batch, self.shift))

    @reinit__is_reduced
    def update(self, output: Sequence[torch.Tensor]) -> None:
        predictions, targets = output[0].detach(), output[1].detach()
        losses = torch.nn.functional.cross_entropy(predictions, targets, ignore_index=IGNORE_INDEX, reduction="none")
        # Float64: the sum does not depend on the sharding.
        self._sum += losses.double().sum().to(self.device)
        self._tokens += (targets != IGNORE_INDEX).sum().to(self.device)

    @reinit__is_reduced
    def _add(self, mean_loss: torch.Tensor, tokens: torch.Tensor) -> None:
        tokens = tokens.to(self.device)
        self._sum += mean_loss.detach().double().to(self.device) * tokens
        self._tokens += tokens

    @sync_all_reduce("_sum", "_tokens")
    def compute(self) -> float:
        tokens = int(self._tokens.item())
        if tokens == 0:
            from ignite.exceptions import NotComputableError

            raise NotComputableError("Perplexity needs at least one token (a label that is not -100).")
        mean = self._sum.item() / tokens
        return math.exp(mean) if mean < 709 else math.inf  # math.exp overflows past e**709


def token_count(batch: Any, shift: bool) -> torch.Tensor:
    """The tokens of a batch a language model averages its loss over: its labels that are not -100, with
    ``shift`` all but each row's first (the model predicts label t + 1 from position t)."""
    labels = batches.labels(batch)
    if shift:
        labels = labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


def create_metrics(
    entries: Sequence[str], model_loss: bool, device: torch.device, args: Mapping[str, Mapping[str, Any]]
) -> dict[str, Metric]:
    """The metric of each ``eval.metrics`` entry but the loss (the evaluator's own), by the name it reports under,
    accumulated on ``device``. ``args``: ``eval.metric_args``, by name."""
    found: dict[str, Metric] = {}
    for entry in entries:
        name = metric_names.name_of(entry)
        if name != "loss":
            found[name] = create_metric(entry, model_loss, device, args.get(name, {}))
    return found


def create_metric(entry: str, model_loss: bool, device: torch.device, args: Mapping[str, Any]) -> Metric:
    """One entry's metric: precision, recall and f1 are macro averages over the classes (every class counts
    alike, a class never predicted counts 0); ``package.module:factory`` is called with ``args``, and with
    ``device`` when it takes one."""
    k = metric_names.top_k(entry)
    if k is not None:
        return TopK(k, device=device)
    if entry == "accuracy":
        return Accuracy(device=device)
    if entry == "precision":
        return Precision(average="macro", device=device)
    if entry == "recall":
        return Recall(average="macro", device=device)
    # F1 of every class from per-class precision and recall (their counts all-reduced), averaged.
    if entry == "f1":
        return Fbeta(beta=1.0, average=True, device=device)
    if entry == "perplexity":
        return Perplexity(model_loss, bool(args.get("shift", False)), device=device)
    return user_metric(entry, args, device)


def user_metric(entry: str, args: Mapping[str, Any], device: torch.device) -> Metric:
    """``package.module:factory`` of ``eval.metrics``, called with ``args`` (and ``device`` when it takes one)."""
    factory = plugins.resolve(entry, "eval.metrics")
    kwargs = plugins.with_extras(factory, args, device=device)
    plugins.check_arguments(factory, kwargs, entry, f"eval.metric_args.{metric_names.name_of(entry)}")
    metric = plugins.call(factory, kwargs, entry, "eval.metrics")
    if not isinstance(metric, Metric):
        raise ConfigError(
            f"eval.metrics entry {entry} returned a {type(metric).__name__}; a metric factory returns an "
            "ignite.metrics.Metric (e.g. ignite.metrics.Precision(average='weighted'), or a subclass of yours)."
        )
    return metric
