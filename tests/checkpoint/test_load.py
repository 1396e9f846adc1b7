"""load_checkpoint: legacy module.-prefixed files, refusal of pickled code, a model mismatch that loads nothing.
`python -m pytest tests/checkpoint/test_load.py`."""

import os
import pickle

import pytest
import torch
from torch import nn

from ignite_mgpu.checkpoint.files import read_checkpoint
from ignite_mgpu.checkpoint.load import load_checkpoint
from ignite_mgpu.errors import CheckpointError
from tests.helpers import small


def test_legacy_dataparallel_file_loads_into_the_plain_model(tmp_path):
    src = small()
    torch.save(nn.DataParallel(src).state_dict(), tmp_path / "legacy.pt")  # every key starts with module.
    target = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    load_checkpoint(tmp_path / "legacy.pt", {"model": target}, map_location="cpu")
    for a, b in zip(src.state_dict().values(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b)


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['SENTINEL']}",))


def test_pickled_code_is_refused_not_executed(tmp_path, monkeypatch):
    sentinel = tmp_path / "SENTINEL"
    monkeypatch.setenv("SENTINEL", str(sentinel))
    with open(tmp_path / "evil.pt", "wb") as f:
        torch.save({"model": Evil()}, f)
    with pytest.raises(CheckpointError, match="refusing to load.*NOT executed"):
        load_checkpoint(tmp_path / "evil.pt", {"model": small()}, map_location="cpu")
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps(Evil()))  # not even a zip archive
    with pytest.raises(CheckpointError):
        read_checkpoint(raw)
    assert not sentinel.exists()


def test_mismatched_model_lists_keys_and_loads_nothing(tmp_path):
    torch.save(small().state_dict(), tmp_path / "a.pt")
    other = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing keys: 3.weight.*shape mismatches: 0.weight"):
        load_checkpoint(tmp_path / "a.pt", {"model": other}, map_location="cpu")
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="has no optimizer"):
        load_checkpoint(tmp_path / "a.pt", {"model": small(), "optimizer": None}, map_location="cpu")
