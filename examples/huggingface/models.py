"""Hugging Face transformers models built from a config, random-initialised: nothing is downloaded
(docs/how-to/huggingface.md). ``model.name: examples.huggingface.models:causal_lm`` with ``model.args``."""

from __future__ import annotations

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification


def causal_lm(model_type: str = "gpt2", **config: object) -> nn.Module:
    """A causal language model (GPT-2 by default); ``config`` are its config's fields (n_layer, n_embd, ...).
    It computes its own loss from ``labels`` (train.loss: model). ``from_pretrained(name)`` would load weights."""
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))


def sequence_classifier(num_classes: int, model_type: str = "bert", **config: object) -> nn.Module:
    """A sequence classifier (BERT by default) with ``num_classes`` labels; it returns ``.logits``, so the default
    train.loss (cross_entropy) trains it and validation reports val_accuracy."""
    return AutoModelForSequenceClassification.from_config(
        AutoConfig.for_model(model_type, num_labels=num_classes, **config)
    )
