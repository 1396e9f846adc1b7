"""Checkpoint files on disk: wrapper prefixes, truncated files skipped by resume, `checkpoint inspect` / `convert`,
and full checkpoints that load with plain torch.load. `python -m pytest tests/checkpoint/test_files.py`."""

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from ignite_mgpu.checkpoint.files import find_resumable, read_checkpoint, strip_prefixes
from ignite_mgpu.cli.commands import main
from ignite_mgpu.errors import CheckpointError
from tests.helpers import small


def test_compiled_and_wrapped_prefixes_are_stripped():
    state = {"module._orig_mod.0.weight": torch.ones(1)}
    assert strip_prefixes(state) == ({"0.weight": state["module._orig_mod.0.weight"]}, ["module.", "_orig_mod."])
    mixed = {"module.a": torch.ones(1), "b": torch.ones(1)}
    assert strip_prefixes(mixed)[1] == []  # only when every key has it


def test_truncated_file_is_reported_and_skipped(tmp_path):
    good = {"model": small().state_dict(), "trainer": {"iteration": 2}}
    torch.save(good, tmp_path / "checkpoint_2.pt")
    torch.save(good, tmp_path / "checkpoint_4.pt")
    data = (tmp_path / "checkpoint_4.pt").read_bytes()
    (tmp_path / "checkpoint_4.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "checkpoint_6.pt").write_bytes(b"")
    assert find_resumable(tmp_path) == tmp_path / "checkpoint_2.pt"
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        read_checkpoint(tmp_path / "checkpoint_4.pt")


def test_inspect_and_convert_cli(tmp_path):
    torch.save(nn.DataParallel(small()).state_dict(), tmp_path / "legacy.pt")
    out = CliRunner().invoke(main, ["checkpoint", "inspect", str(tmp_path / "legacy.pt")]).output
    assert "prefixes: ['module.']" in out and "parameters: 23" in out
    result = CliRunner().invoke(main, ["checkpoint", "convert", str(tmp_path / "legacy.pt"), str(tmp_path / "c.pt")])
    assert result.exit_code == 0 and "stripped module." in result.output
    small().load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    bad = CliRunner().invoke(main, ["checkpoint", "inspect", str(tmp_path / "nope.pt")])
    assert bad.exit_code == 2 and "does not exist" in bad.output


def test_old_checkpoints_with_numpy_rng_state_still_load(tmp_path):
    from ignite.engine import DeterministicEngine

    from ignite_mgpu.train.step.deterministic import PortableDeterministicEngine

    old = DeterministicEngine(lambda e, b: None)
    old.run(range(4), max_epochs=1)
    torch.save({"trainer": old.state_dict()}, tmp_path / "old.pt")  # numpy's RNG state, as ignite writes it
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(tmp_path / "old.pt", weights_only=True)  # our allow-list is scoped to our own reading
    engine = PortableDeterministicEngine(lambda e, b: None)
    engine.load_state_dict(read_checkpoint(tmp_path / "old.pt")["trainer"])
    assert engine.state.iteration == 4
    new = engine.state_dict()
    torch.save({"trainer": new}, tmp_path / "new.pt")
    assert torch.load(tmp_path / "new.pt", weights_only=True)["trainer"]["iteration"] == 4  # no allow-list needed
