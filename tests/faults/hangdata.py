"""Test-only datasets for the hang tests (tests/faults/test_hangs.py): 3x8x8 images (``faultmod:make8``) whose
``__getitem__`` hangs or slows down on request. Passed as ``data.name=hangdata:images`` with ``data.args``:

- ``hang="R:N"``: on global rank R, the N-th training item this process reads sleeps for an hour (a stuck read).
- ``slow="R:S"``: on global rank R (``*``: every rank), every training item sleeps S seconds (a slow but live rank).
- ``collective="R:N"``: on global rank R, the N-th training item calls an all-reduce on a group that the other
  ranks created too but never use (a rank-dependent collective).
- ``val_slow=S``: every validation item sleeps S seconds, on every rank (a long evaluation).
"""

from __future__ import annotations

import os
import time

import torch
from torch.utils.data import Dataset


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Images(Dataset):
    def __init__(self, n: int, seed: int, hang_at: int = 0, sleep: float = 0.0, group: bool = False) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 8, 8, generator=generator)
        self.y = torch.randint(0, 10, (n,), generator=generator)
        self.hang_at, self.sleep, self.reads, self.group = hang_at, sleep, 0, group

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        # At the first read in a worker, on every rank (the datasets are built one rank after the other).
        if self.group is True and torch.distributed.is_initialized():
            self.group = torch.distributed.new_group([0, 1])
        if self.reads == self.hang_at and self.group:
            torch.distributed.all_reduce(torch.zeros(1), group=self.group)  # the other rank never comes
        elif self.reads == self.hang_at:
            time.sleep(3600)  # the stuck read the hang report must name
        if self.sleep:
            time.sleep(self.sleep)
        return self.x[i], self.y[i]


def _on_this_rank(spec: str) -> float:
    if not spec:
        return 0.0
    rank, value = spec.split(":")
    return float(value) if rank == "*" or int(rank) == _rank() else 0.0


def images(
    n: int = 640, val: int = 100, hang: str = "", slow: str = "", val_slow: float = 0.0, collective: str = ""
) -> tuple:
    group = bool(collective)
    hang_at = int(_on_this_rank(hang) or _on_this_rank(collective))
    return Images(n, 0, hang_at, _on_this_rank(slow), group), Images(val, 1, sleep=val_slow)
