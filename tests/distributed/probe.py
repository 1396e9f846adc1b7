"""Test-only model factory for tests/distributed/test_binding.py: passed to the real CLI as
``model.name=tests.distributed.probe:make``; each rank records where it runs (its affinity, intra-op threads and
OMP_NUM_THREADS) in ``probe-rank{RANK}.json`` in the working directory, then gets a tiny linear model (8x8 images)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn


def make(num_classes: int) -> nn.Module:
    if torch.empty(0).is_meta:  # the launcher's check before spawning (preflight): not a rank
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))
    seen = {
        "affinity": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }
    Path(f"probe-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))
