"""Every rank's stacks on a signal (hangs/stacks.py), against real processes: a child that registered its
handler and sleeps in a known function, answered while running and while stopped; `ignite-mgpu stacks` on a
folder or pid that holds no live job, on a forged launcher folder in a shared temporary folder (nothing signalled),
and on a launcher's folder naming a process that is not its worker."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.env import launcher_dir
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


def test_stacks_command_names_a_missing_path_and_a_file(tmp_path: Path):
    result = CliRunner().invoke(main, ["stacks", str(tmp_path / "gone")])
    assert result.exit_code == 2 and f"{tmp_path / 'gone'} does not exist." in result.output, result.output
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(main, ["stacks", str(tmp_path / "file")])
    assert result.exit_code == 2 and f"{tmp_path / 'file'} is not a folder." in result.output, result.output


# A launcher's stand-in: it makes its private folder as the supervisor does, holds it, and forks a worker that
# registers its stack handler in attempt0; it prints its folder once the worker's file is there.
LAUNCHER = """
import os, sys, time
from ignite_mgpu.env import launcher_dir
from ignite_mgpu.hangs import stacks

folder, held = launcher_dir.make()
(folder / "attempt0").mkdir()
if os.fork() == 0:
    stacks.register(folder / "attempt0", 0)
    time.sleep(60)
    os._exit(0)
while not stacks.ranks_in(folder / "attempt0"):
    time.sleep(0.02)
print(folder, flush=True)
time.sleep(60)
"""


def _start(args: list[str], tmp: Path, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
    proc = subprocess.Popen(args, env=env, start_new_session=True, **kwargs)
    deadline = time.monotonic() + 10
    while f"TMPDIR={tmp}" not in stacks._proc(proc.pid, "environ") and time.monotonic() < deadline:
        time.sleep(0.01)  # its environment as `stacks` reads it
    return proc


def _untouched(path: Path, pid: int) -> None:
    """Process ``pid`` never received the stacks signal: its handler wrote nothing into ``path``; it still runs."""
    time.sleep(0.3)
    assert path.stat().st_size == 0 and stacks.state(pid) not in ("", "Z")


@pytest.mark.parametrize("forged", ["another user's", "not private", "not held by the pid"])
def test_a_forged_launcher_folder_in_the_shared_temporary_folder_signals_nothing(child, tmp_path, forged):
    """Someone makes ignite-mgpu-<L>-0/attempt0/stacks0-<V>.txt in the shared temporary folder: `stacks L` signals
    neither V (a process that catches the signal) nor anything else, and refuses saying why (exit 2)."""
    victim, victim_folder = child
    [victim_rank] = stacks.ranks_in(victim_folder)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    launcher = _start(["sleep", "60"], shared)  # a live pid that runs no ignite-mgpu job
    try:
        forged_dir = shared / f"ignite-mgpu-{launcher.pid}-0"
        (forged_dir / "attempt0").mkdir(parents=True)
        (forged_dir / "attempt0" / f"stacks0-{victim.pid}.txt").write_text("")
        forged_dir.chmod(0o755 if forged == "not private" else 0o700)
        if forged == "another user's":
            if os.geteuid() != 0:
                pytest.skip("only root can make a folder of another uid")
            for path in (forged_dir, forged_dir / "attempt0", *forged_dir.rglob("*")):
                os.chown(path, 65534, 65534)
        result = CliRunner().invoke(main, ["stacks", str(launcher.pid)])
        why = {
            "another user's": r"belongs to (nobody|uid 65534), not to \S+: another user made it",
            "not private": r"is not private \(mode 0755; a launcher makes its folder 0700\)",
            "not held by the pid": rf"is not held open by process {launcher.pid}, so no live launcher of ignite-mgpu "
            "made it",
        }[forged]
        assert result.exit_code == 2, result.output
        said = rf"this user can trust: {re.escape(str(forged_dir))} {why}\. Nothing was signalled;"
        assert re.search(rf"process {launcher.pid} runs no job of ignite-mgpu that {said}", result.output), (
            result.output
        )
        assert "=== rank" not in result.output
        _untouched(victim_rank.path, victim.pid)
    finally:
        launcher.kill()
        launcher.wait()


def test_only_the_launchers_own_workers_are_asked_for_their_stacks(child, tmp_path):
    """The launcher's own folder, with a stacks file naming a process that is not its descendant (a pid reused
    since its worker ended): only the worker answers."""
    victim, victim_folder = child
    [victim_rank] = stacks.ranks_in(victim_folder)
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    launcher = _start([sys.executable, str(script)], tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        folder = Path(launcher.stdout.readline().strip())
        assert folder.parent == tmp_path and launcher_dir.why_untrusted(folder, launcher.pid) is None
        (folder / "attempt0" / f"stacks1-{victim.pid}.txt").write_text("")
        [rank] = stacks.live_ranks(str(launcher.pid))
        assert rank.rank == 0 and stacks.descends_from(rank.pid, launcher.pid)
        result = CliRunner().invoke(main, ["stacks", str(launcher.pid)])
        assert result.exit_code == 0 and "=== rank 0 ===" in result.output and "=== rank 1" not in result.output
        _untouched(victim_rank.path, victim.pid)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_the_folders_of_dead_launchers_are_removed_and_no_other(tmp_path):
    """A launcher killed by SIGKILL leaves its folder; the next one of this user removes it, and nothing else that
    matches the name: a live pid's, one whose flock a launcher holds (of another container, whose pid this one cannot
    see), one made less than a minute ago, one that is not private, a symlink, another user's."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "30"])
    hour_ago = time.time() - 3600
    try:
        dead = tmp_path / f"ignite-mgpu-{gone.pid}-abc"
        (dead / "attempt0").mkdir(parents=True)
        dead.chmod(0o700)
        names = [
            "ignite-mgpu-{alive}-x",
            "ignite-mgpu-{gone}-open",
            "ignite-mgpu-{gone}-locked",
            "ignite-mgpu-{gone}-new",
        ]
        kept = [tmp_path / name.format(alive=alive.pid, gone=gone.pid) for name in names]
        for path in kept:
            path.mkdir(mode=0o700)
        kept[1].chmod(0o755)
        (tmp_path / f"ignite-mgpu-{gone.pid}-link").symlink_to(kept[0])
        kept.append(tmp_path / f"ignite-mgpu-{gone.pid}-link")
        if os.geteuid() == 0:
            theirs = tmp_path / f"ignite-mgpu-{gone.pid}-theirs"
            theirs.mkdir(mode=0o700)
            os.chown(theirs, 65534, 65534)
            kept.append(theirs)
        for path in [dead, *kept[:3], *kept[4:]]:
            os.utime(path, (hour_ago, hour_ago), follow_symlinks=False)
        held = os.open(kept[2], os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(held, fcntl.LOCK_EX)  # as a live launcher holds its own
        try:
            assert launcher_dir.remove_dead(str(tmp_path)) == [dead]
        finally:
            os.close(held)
        assert not dead.exists() and all(os.path.lexists(path) for path in kept)
    finally:
        alive.kill()
        alive.wait()
