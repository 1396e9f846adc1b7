"""Byte-level datasets for the Hugging Face examples, as the mappings transformers models take (input_ids,
attention_mask, labels); a text in the repository stands in for a tokenized corpus."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

CORPUS = Path(__file__).parents[1] / "charlm" / "corpus.txt"


class TextWindows(Dataset):
    """Windows of ``block`` bytes; ``labels`` are the inputs themselves (a causal LM shifts them inside)."""

    def __init__(self, data: torch.Tensor, block: int, stride: int) -> None:
        self.data, self.block = data, block
        self.starts = range(0, len(data) - block, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.data[self.starts[index] : self.starts[index] + self.block]
        return {"input_ids": window, "attention_mask": torch.ones_like(window), "labels": window}


def _bytes() -> torch.Tensor:
    return torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)


def text(block: int = 64, stride: int = 16, val_fraction: float = 0.1) -> dict[str, Dataset]:
    """Causal LM data: training windows from the text's first part, validation from its last part."""
    data = _bytes()
    split = int(len(data) * (1 - val_fraction))
    return {"train": TextWindows(data[:split], block, stride), "val": TextWindows(data[split:], block, block)}


class ForwardOrReversed(Dataset):
    """Sequence classification: a window of the text (label 0) or the same window reversed (label 1)."""

    def __init__(self, windows: TextWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return 2 * len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = dict(self.windows[index // 2])
        reverse = index % 2
        if reverse:
            item["input_ids"] = item["input_ids"].flip(0)
        item["labels"] = torch.tensor(reverse)
        return item


def direction(block: int = 32, stride: int = 16, val_fraction: float = 0.1) -> dict[str, Dataset]:
    """Classification data: is the text read forwards or backwards?"""
    splits = text(block, stride, val_fraction)
    return {name: ForwardOrReversed(windows) for name, windows in splits.items()}  # type: ignore[arg-type]
