"""The dataset factory of configs/charlm.yaml: windows of a text's bytes, as Hugging Face-style mappings
(``input_ids`` and ``labels``, the next byte of each position). ``data.name: examples.charlm.data:build``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

CORPUS = Path(__file__).with_name("corpus.txt")  # the opening of Alice's Adventures in Wonderland (public domain)


class ByteWindows(Dataset):
    """Windows of ``block`` bytes starting every ``stride`` bytes; each item predicts the next byte."""

    def __init__(self, data: torch.Tensor, block: int, stride: int) -> None:
        self.data, self.block = data, block
        self.starts = range(0, len(data) - block - 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self.starts[index]
        chunk = self.data[start : start + self.block + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


def build(path: str | None = None, block: int = 64, stride: int = 8, val_fraction: float = 0.1) -> dict:
    """Training windows from the text's first part, validation windows (not overlapping) from its last part."""
    text = Path(path).read_bytes() if path else CORPUS.read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    split = int(len(data) * (1 - val_fraction))
    return {"train": ByteWindows(data[:split], block, stride), "val": ByteWindows(data[split:], block, block)}
