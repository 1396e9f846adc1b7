"""Every rank's stacks on a signal (hangs/stacks.py), against real processes: a child that registered its
handler and sleeps in a known function, answered while running and while stopped; `ignite-mgpu stacks` on a
folder or pid that holds no live job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.hangs import stacks
from ignite_mgpu.hangs.hang_report import where

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import sys, time
from ignite_mgpu.hangs import stacks

def stuck_here():
    stacks.register(sys.argv[1], 3)
    time.sleep(60)

stuck_here()
"""


@pytest.fixture
def child(tmp_path: Path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    deadline = time.monotonic() + 30
    while not stacks.ranks_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield proc, tmp_path
    proc.kill()
    proc.wait()


def test_a_registered_process_answers_with_its_stack_and_goes_on(child):
    proc, folder = child
    [rank] = stacks.ranks_in(folder)
    assert (rank.rank, rank.pid) == (3, proc.pid) and stacks.catches(proc.pid)
    text = stacks.dump([rank])[3]
    found = where(text)
    assert found.frame is not None and found.frame.function == "stuck_here", text
    assert found.frame.file.endswith("child.py") and found.collective is None
    assert proc.poll() is None  # still running
    assert "stuck_here" in stacks.dump([rank])[3]  # again: each dump is read from where the last one ended


def test_a_stopped_process_is_named_and_answers_once_continued(child):
    proc, folder = child
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while stacks.state(proc.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        ranks = stacks.ranks_in(folder)
        text = stacks.dump(ranks, wait=0.5)[3]
        assert text.startswith(f"(process {proc.pid} was stopped (SIGSTOP, state T); no stack until it continues)")
        assert "stuck_here" not in text
        assert "stuck_here" in stacks.dump(ranks, resume_stopped=True)[3]
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_a_process_without_the_handler_is_never_signalled():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not stacks.catches(proc.pid)
        text = stacks.dump([stacks.Rank(0, proc.pid, Path(os.devnull))], wait=0.2)[0]
        assert "did not answer" in text and proc.poll() is None  # the signal's default action would end it
    finally:
        proc.kill()
        proc.wait()


def test_stacks_command_refuses_a_folder_without_a_live_job(tmp_path: Path):
    result = CliRunner().invoke(main, ["stacks", str(tmp_path)])
    assert result.exit_code == 2
    assert f"{tmp_path} holds no live job on this machine: its lock is held by no running job" in result.output


def test_stacks_command_refuses_a_pid_without_a_job():
    """A live process that never launched a job (not this test process: an earlier test may have launched one in
    it, and its temporary folder would name it)."""
    import subprocess

    other = subprocess.Popen(["sleep", "30"])
    try:
        result = CliRunner().invoke(main, ["stacks", str(other.pid)])
    finally:
        other.kill()
        other.wait()
    assert result.exit_code == 2
    assert f"process {other.pid} runs no job of ignite-mgpu that this user can see" in result.output
