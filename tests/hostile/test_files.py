"""Files with hostile contents: a zero-byte or random-bytes checkpoint given to `checkpoint inspect`, `checkpoint
convert` or `evaluate --checkpoint`, a YAML config whose top level is a list. Each is one paragraph, exit 2.
`python -m pytest tests/hostile`."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from ignite_mgpu.checkpoint.files import read_checkpoint
from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.errors import CheckpointError, ConfigError
from tests.conftest import TINY
from tests.hostile.bounded import one_paragraph, run_bounded


@pytest.fixture
def empty(tmp_path):
    (tmp_path / "checkpoint_4.pt").write_bytes(b"")
    return tmp_path / "checkpoint_4.pt"


def test_zero_bytes_and_random_bytes_say_what_they_are(tmp_path, empty):
    with pytest.raises(CheckpointError, match=r"checkpoint_4.pt is empty \(0 bytes\)"):
        read_checkpoint(empty)
    (tmp_path / "random.pt").write_bytes(os.urandom(3000))
    with pytest.raises(CheckpointError, match="corrupt or truncated.*not a torch checkpoint") as info:
        read_checkpoint(tmp_path / "random.pt")
    assert "arbitrary Python code" not in str(info.value)


@pytest.mark.parametrize("command", [["inspect"], ["convert"]])
def test_checkpoint_commands_on_an_empty_file_are_one_paragraph(tmp_path, empty, command):
    args = ["checkpoint", *command, str(empty)] + (
        [str(tmp_path / "out.safetensors")] if command == ["convert"] else []
    )
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "is empty (0 bytes)" in one_paragraph(result.output)
    assert not (tmp_path / "out.safetensors").exists()


def test_a_yaml_list_is_one_paragraph(tmp_path):
    (tmp_path / "list.yaml").write_text("- data:\n    batch_size: 8\n- train:\n    epochs: 2\n")
    with pytest.raises(ConfigError, match="its top level is a list, not a mapping of sections"):
        load_config(tmp_path / "list.yaml")


@pytest.mark.slow
def test_evaluate_an_empty_checkpoint_is_one_paragraph_and_leaves_no_process(tmp_path, empty):
    # On 2 processes the fork server imports beside the checkpoint's check: the refusal stops it first.
    result = run_bounded(["evaluate", "--nproc", "2", "--checkpoint", str(empty), *TINY], tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "is empty (0 bytes)" in one_paragraph(result.stderr)
    assert result.left == []
