"""Paths that are not regular files, named by the user or found in the run folder: a FIFO, /dev/zero, a device
symlink, a folder. Each ends in one paragraph within seconds and bounded memory. `python -m pytest tests/hostile`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ignite_mgpu.checkpoint.files import find_resumable, is_complete, is_safetensors, list_checkpoints
from ignite_mgpu.errors import CheckpointError
from ignite_mgpu.runs.regular import NotRegular, read_regular, why_not_regular
from tests.conftest import TINY
from tests.hostile.bounded import one_paragraph, run_bounded

ZERO = "/dev/zero"


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "checkpoint_8.pt"
    os.mkfifo(path)
    return path


def test_why_not_regular_names_each_kind(tmp_path, fifo):
    (tmp_path / "f").write_bytes(b"x")
    os.symlink(ZERO, tmp_path / "dev")
    os.symlink(tmp_path / "f", tmp_path / "link")
    os.symlink(tmp_path / "gone", tmp_path / "broken")
    assert why_not_regular(tmp_path / "f") is None
    assert why_not_regular(tmp_path / "link") is None  # a symlink to a regular file is followed
    assert "FIFO" in why_not_regular(fifo)
    assert why_not_regular(ZERO) == "is a character device, not a regular file"
    assert why_not_regular(tmp_path / "dev") == "is a symlink to a character device, not a regular file"
    assert "folder" in why_not_regular(tmp_path)
    assert "broken symlink" in why_not_regular(tmp_path / "broken")
    assert "no such file" in why_not_regular(tmp_path / "none")


def test_read_regular_is_bounded(tmp_path, fifo):
    (tmp_path / "big").write_bytes(b"x" * 100)
    assert read_regular(tmp_path / "big", 100) == b"x" * 100
    with pytest.raises(NotRegular, match="100 bytes, more than the 99"):
        read_regular(tmp_path / "big", 99)
    for path in (fifo, ZERO, tmp_path):
        with pytest.raises(NotRegular, match="not a regular file"):
            read_regular(path, 1 << 20)


def test_what_is_read_is_the_file_that_was_checked(tmp_path, monkeypatch):
    """A checkpoint swapped for a FIFO after its check: the reader holds the checked file open and reads it through
    its descriptor; swapped between the check and the open, the open file's own kind refuses it, without blocking."""
    import torch

    from ignite_mgpu.checkpoint.files import read_checkpoint
    from ignite_mgpu.runs import regular

    path = tmp_path / "checkpoint_4.pt"
    torch.save({"model": {"w": torch.ones(2)}}, path)
    with regular.opened_regular(path) as name:
        path.unlink()
        os.mkfifo(path)  # what a later open of the path would block on
        assert torch.equal(torch.load(name, weights_only=True)["model"]["w"], torch.ones(2))
    monkeypatch.setattr(regular, "why_not_regular", lambda _: None)  # the check saw a regular file
    with pytest.raises(NotRegular, match="is a FIFO"):
        regular.open_regular(path)
    with pytest.raises(CheckpointError, match="is a FIFO .named pipe., not a regular file; pass the path"):
        read_checkpoint(path)
    assert not is_complete(path) and not is_safetensors(path)


def test_checkpoint_checks_never_open_what_is_not_a_regular_file(tmp_path, fifo, caplog):
    os.symlink(ZERO, tmp_path / "checkpoint_9.pt")
    for path in (fifo, tmp_path / "checkpoint_9.pt", Path(ZERO)):
        assert not is_safetensors(path) and not is_complete(path)
    assert list_checkpoints(tmp_path) == []
    assert find_resumable(tmp_path) is None
    # said once for each name, however often the folder is listed
    assert caplog.text.count("only regular files are read as checkpoints") == 2, caplog.text


@pytest.mark.parametrize("target", ["fifo", ZERO])
def test_checkpoint_inspect_names_what_the_path_is(tmp_path, fifo, target):
    from ignite_mgpu.checkpoint.files import read_checkpoint

    path = fifo if target == "fifo" else target
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_checkpoint(path)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["fifo", ZERO])
def test_resume_from_what_is_not_a_file_is_one_paragraph(tmp_path, fifo, target):
    path = str(fifo) if target == "fifo" else ZERO
    out = tmp_path / "run"
    result = run_bounded(["train", "--nproc", "1", "--output-dir", str(out), "--resume", path, *TINY], tmp_path)
    assert result.returncode == 2, result.stderr
    text = one_paragraph(result.stderr)
    assert f"--resume {path}: it is {'a FIFO' if target == 'fifo' else 'a character device'}" in text
    assert result.seconds < 30
    assert not out.exists()  # nothing started


@pytest.mark.slow
def test_inspect_and_config_on_a_fifo_are_one_paragraph(tmp_path, fifo):
    result = run_bounded(["checkpoint", "inspect", str(fifo)], tmp_path, timeout=60)
    assert result.returncode == 2 and "FIFO (named pipe), not a regular file" in one_paragraph(result.stderr)
    result = run_bounded(["train", "--config", str(fifo)], tmp_path, timeout=60)
    assert result.returncode == 2 and "FIFO (named pipe), not a regular file" in one_paragraph(result.stderr)
    result = run_bounded(["checkpoint", "inspect", ZERO], tmp_path, timeout=60)
    assert result.returncode == 2 and "character device" in one_paragraph(result.stderr)


@pytest.mark.slow
def test_device_symlink_in_the_run_folder_is_skipped_under_resume_auto(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(ZERO, out / "checkpoint_99.pt")
    args = ["train", "--nproc", "1", "--output-dir", str(out), "--resume", "auto", *TINY, "train.epochs=1"]
    result = run_bounded(args, tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "only regular files are read as checkpoints" in result.stderr
    assert os.path.islink(out / "checkpoint_99.pt")  # never deleted, never read
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint_8.pt"]
