"""Folder and disk problems before training are one paragraph, exit 2, naming the folder, what is wrong and the fix:
an output_dir that is a file, a folder under a file, a read-only file system, an immutable folder, a full disk when
the lock is written; a full disk during a save names the folder and its free space. `python -m pytest tests/hostile`."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from ignite_mgpu.checkpoint.disk import SafeDiskSaver
from ignite_mgpu.errors import CheckpointError, ConfigError
from ignite_mgpu.runs import lock, writable
from ignite_mgpu.runs.writable import folder_problem
from tests.conftest import TINY
from tests.hostile.bounded import one_paragraph, run_bounded


def test_a_file_in_the_place_of_the_folder_or_above_it(tmp_path):
    (tmp_path / "file").write_text("x")
    assert folder_problem(tmp_path / "file") == (
        f"output_dir {tmp_path / 'file'} is a regular file, not a folder: remove it or choose another --output-dir."
    )
    msg = folder_problem(tmp_path / "file" / "run" / "deeper")
    assert f"cannot be made: {tmp_path / 'file'} is a regular file, not a folder" in msg
    os.mkfifo(tmp_path / "fifo")
    assert "is a FIFO (named pipe), not a folder" in folder_problem(tmp_path / "fifo")
    assert folder_problem(tmp_path / "new" / "run") is None and folder_problem(tmp_path) is None


def _statvfs(flag=0, bavail=1000, favail=1000, files=5000):
    fields = {"f_flag": flag, "f_blocks": 5000, "f_bavail": bavail, "f_files": files, "f_favail": favail}
    return lambda path: SimpleNamespace(**fields, f_frsize=4096)


def test_a_read_only_file_system_and_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(writable.os, "statvfs", _statvfs(flag=os.ST_RDONLY))
    assert folder_problem(tmp_path / "run") == (
        f"output_dir {tmp_path / 'run'} cannot be made: {tmp_path} is on a read-only file system. Fix that or "
        "choose another --output-dir."
    )
    monkeypatch.setattr(writable.os, "statvfs", _statvfs(bavail=0))
    assert f"cannot be written: the disk of {tmp_path} is full (no free blocks)" in folder_problem(tmp_path)
    monkeypatch.setattr(writable.os, "statvfs", _statvfs(favail=0))
    assert f"the disk of {tmp_path} is full (no free inodes)" in folder_problem(tmp_path)
    monkeypatch.setattr(writable.os, "statvfs", _statvfs(favail=0, files=0))  # btrfs: no inode count
    assert folder_problem(tmp_path) is None


def test_an_immutable_folder(tmp_path):
    folder = tmp_path / "frozen"
    folder.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i needs root and a file system with its flags")
    try:
        assert "frozen is immutable (chattr +i" in folder_problem(folder / "run")
        with pytest.raises(ConfigError, match="immutable"), lock.output_lock(folder / "run"):
            pass
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_full_disk_when_the_lock_is_written(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock.os, "write", full)
    with pytest.raises(ConfigError, match=r"cannot be written: no space left on its disk\. Free some space"):
        with lock.output_lock(tmp_path / "run"):
            pass
    assert not (tmp_path / "run" / ".lock").exists()


def test_a_full_disk_during_a_save_names_the_folder_and_its_free_space(tmp_path, monkeypatch):
    def unexpected_pos(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    saver = SafeDiskSaver(tmp_path)
    torch.save({"x": 1}, tmp_path / "checkpoint_2.pt")
    monkeypatch.setattr(torch, "save", unexpected_pos)
    with pytest.raises(
        CheckpointError, match=rf"No space left on device: {tmp_path} has \d+\.\d MiB free\).*checkpoint_2.pt"
    ):
        saver({"x": 2}, "checkpoint_4.pt")


@pytest.mark.slow
def test_output_dir_that_is_a_file_is_one_paragraph_exit_2(tmp_path):
    (tmp_path / "taken").write_text("notes")
    for out in (tmp_path / "taken", tmp_path / "taken" / "run"):
        result = run_bounded(["train", "--nproc", "1", "--output-dir", str(out), *TINY], tmp_path, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "is a regular file, not a folder" in one_paragraph(result.stderr)
    assert (tmp_path / "taken").read_text() == "notes"  # nothing lost
