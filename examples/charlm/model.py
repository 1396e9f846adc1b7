"""The model factory of configs/charlm.yaml: a byte-level GRU language model that computes its own loss and returns
it as ``.loss``, as Hugging Face models do (``train.loss: model``). ``model.name: examples.charlm.model:build``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VOCAB = 256  # bytes


@dataclass
class LMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class CharLM(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LMOutput:
        logits = self.head(self.rnn(self.embed(input_ids))[0])
        loss = None if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return LMOutput(logits, loss)


def build(dim: int = 64, hidden: int = 128) -> nn.Module:
    return CharLM(dim, hidden)
