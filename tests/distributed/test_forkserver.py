"""The fork server (launch/forkserver.py), in one 2-process gloo job run by launch() in this process: workers
forked from a server that imported torch, the supervisor's environment (set after the server started) in the
workers, CUDA untouched there, a DataLoader with a worker process, and a rank's SIGKILL restarted at once by the same
server, stopped when the job ends; the rendezvous file in a temporary folder whose path no file:// URL carries.
`python -m pytest tests/distributed/test_forkserver.py`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import util as mp_util
from pathlib import Path
from unittest import mock

import pytest

from ignite_mgpu.processes import forkserver, launcher
from tests.conftest import REPO, TINY

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def blas_threads(_: int = 0) -> list[int]:
    """The thread count of every BLAS library loaded here (numpy's OpenBLAS, loaded by the server's torch)."""
    from threadpoolctl import threadpool_info

    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def job(local_rank: int, folder: str) -> dict:
    """Each rank notes its parent and what it found; rank 1 SIGKILLs itself once, in the first attempt."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    rank = dist.get_rank()
    seen = {
        "parent": os.getppid(),
        "late_variable": os.environ.get("FORKSRV_SET_AFTER_START"),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "cuda_initialized": torch.cuda.is_initialized(),
        "bad_fork": torch.cuda._is_in_bad_fork(),
        "preloaded": "torch._dynamo" in sys.modules,  # imported by the server, not by this process
        "batches": [b.tolist() for b in DataLoader(torch.arange(4), batch_size=2, num_workers=1)],
        "blas": blas_threads(),
        "loader_blas": list(DataLoader(_BlasThreads(), batch_size=None, num_workers=1)),
    }
    with Path(folder, f"rank{rank}.jsonl").open("a") as f:
        f.write(json.dumps(seen) + "\n")
    marker = Path(folder, "killed")
    if rank == 1 and not marker.exists():
        marker.write_text("once")
        end = time.monotonic() + 60  # rank 0 has noted what it found first (on a loaded machine it may lag)
        while not Path(folder, "rank0.jsonl").exists() and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return seen


class _BlasThreads:
    """A one-item dataset: the BLAS thread counts in the DataLoader's worker process."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> list[int]:
        return blas_threads()


@pytest.mark.timeout(180)
def test_workers_fork_from_one_server_with_the_supervisors_environment(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the server's torch starts with one thread per core
    servers = []
    start = forkserver.start

    def start_then_change_the_environment(*args, **kwargs):
        pid = start(*args, **kwargs)
        servers.append(pid)
        monkeypatch.setenv("FORKSRV_SET_AFTER_START", "yes")  # after the server copied the environment
        return pid

    monkeypatch.setattr(forkserver, "start", start_then_change_the_environment)
    # The rendezvous file lies in the temporary folder: "env" in its path (ignite took such a URL for env://),
    # and a URL's "?" and "#".
    mp_util.get_temp_dir()  # multiprocessing's own (its fork server's socket) stays where it is
    temporary = tempfile.mkdtemp(prefix="venv?#")
    try:
        with mock.patch.object(tempfile, "tempdir", temporary):
            result = launcher.launch(job, str(tmp_path), nproc=2, backend="gloo", max_restarts=1)
    finally:
        shutil.rmtree(temporary)

    lines = {
        rank: [json.loads(x) for x in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()] for rank in (0, 1)
    }
    assert [len(lines[0]), len(lines[1])] == [2, 2]  # two attempts, each rank once in each
    server = servers[0]
    assert set(servers) == {server}  # one server, for the first attempt and the restart
    for seen in (*lines[0], *lines[1]):
        assert seen["parent"] == server
        assert seen["late_variable"] == "yes"
        assert seen["omp"] == str(max(1, (os.cpu_count() or 1) // 2))  # the plan's, and torch follows it
        assert seen["threads"] == int(seen["omp"])
        # numpy's BLAS, loaded in the server with one thread per core, follows torch in the worker and its loader
        assert seen["blas"] and set(seen["blas"]) == {seen["threads"]}, seen
        assert seen["loader_blas"] == [seen["blas"]], seen
        assert not seen["cuda_initialized"] and not seen["bad_fork"]
        assert seen["preloaded"] and seen["batches"] == [[0, 1], [2, 3]]
    assert result == lines[0][1]
    err = capfd.readouterr().err
    assert "restart 1 of 1 (dist.max_restarts) after rank 1 failed, at once (one rank died)" in err, err
    # Stopped with the job: nothing of it outlives launch().
    assert mp_forkserver._forkserver._forkserver_pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append((int(entry.name), cmdline))
    return found


@pytest.mark.timeout(120)
def test_ctrl_c_while_the_server_imports_stops_the_job_at_once_with_130_and_no_traceback(tmp_path):
    """A terminal's Ctrl-C reaches the whole foreground group: the command and its fork server, which is still
    importing torch. The server ignores it (blocked from its start until it ignores it), the supervisor kills the
    worker it was starting, and the command ends with 130 at once, without a traceback."""
    cmd = [sys.executable, "-m", "ignite_mgpu", "train", *TINY, "--nproc", "2", "--output-dir", str(tmp_path / "run")]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stderr=subprocess.PIPE, start_new_session=True)
    end = time.monotonic() + 60
    while not any("multiprocessing.forkserver" in line for _, line in _children(proc.pid)):
        assert proc.poll() is None and time.monotonic() < end, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    signalled = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Aborted" not in err, err
    # The supervisor's two lines; or, when the signal came before the supervisor took over (the server starts
    # just before it), the command's one line.
    supervisor = "ignite-mgpu: SIGINT received while the workers start: they are stopped at once.\n"
    assert err.endswith(f"{supervisor}ignite-mgpu: stopped by SIGINT.\n") or err.endswith(
        "\nignite-mgpu: stopped by Ctrl-C (SIGINT).\n"
    ), err
    assert time.monotonic() - signalled < 20, "it waited for the workers' stop grace"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no epoch ran
    for _ in range(40):  # the server dies with the command
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.25)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("a process of the command outlived it")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tmpdir_too_long_for_a_unix_socket_still_starts_the_server(tmp_path):
    """A TMPDIR as SLURM's per-job scratch folders or macOS's per-user ones can be, past the 107 bytes of a Unix
    socket's path once multiprocessing adds its folder and socket to it: the job runs (the socket's folder in /tmp),
    not ``OSError: AF_UNIX path too long``."""
    long = tmp_path / ("scratch-" + "x" * 80)
    long.mkdir()
    cmd = [sys.executable, "-m", "ignite_mgpu", "train", *TINY, "train.epochs=1", "--nproc", "2"]
    env = os.environ | {"PYTHONPATH": str(REPO), "TMPDIR": str(long)}
    done = subprocess.run([*cmd, "--output-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(os.fsencode(long / "pymp-xxxxxxxx" / "listener-xxxxxxxx")) > 107


def test_ctrl_c_before_the_supervisor_ends_the_command_with_130_and_one_line(monkeypatch):
    """A Ctrl-C in the checks before anything starts: 130 and one line, not click's "Aborted!" and 1."""
    from click.testing import CliRunner

    from ignite_mgpu import jobs
    from ignite_mgpu.cli.commands import main

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(jobs, "fit", interrupted)
    result = CliRunner().invoke(main, ["train", "--nproc", "2"])
    assert result.exit_code == 130, result.output
    assert result.output == "\nignite-mgpu: stopped by Ctrl-C (SIGINT).\n"


def _ignores_sigint(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.timeout(60)
def test_a_killed_server_is_started_again_as_the_first_one_was():
    """The OOM killer or a kill by hand ends the server between attempts: the next start gives a server that again
    ignores the stop signals (set up by the same code as its death signal), not multiprocessing's plain one, and
    replaces a plain one that multiprocessing started in its place."""

    def start_and_wait() -> int:
        pid = forkserver.start([forkserver.__name__])
        end = time.monotonic() + 20
        while not _ignores_sigint(pid):  # set once the server imported its preload
            assert time.monotonic() < end, "the server never ignored SIGINT"
            time.sleep(0.01)
        return pid

    try:
        first = start_and_wait()
        os.kill(first, signal.SIGKILL)
        while _state(first) not in ("Z", "gone"):
            time.sleep(0.01)
        second = start_and_wait()
        assert second != first and forkserver._started == [second]
        # Ours dies as a worker starts: multiprocessing itself starts a plain one, which the next start replaces.
        os.kill(second, signal.SIGKILL)
        while _state(second) not in ("Z", "gone"):
            time.sleep(0.01)
        mp_forkserver.ensure_running()
        plain = mp_forkserver._forkserver._forkserver_pid
        assert plain not in (None, second)
        third = start_and_wait()
        assert third not in (plain, second) and forkserver._started == [third]
        assert _state(plain) == "gone"  # killed and waited for
    finally:
        forkserver.stop()
    assert mp_forkserver._forkserver._forkserver_pid is None


def kills_its_server(local_rank: int) -> None:
    """Rank 0 kills the fork server that forked it, as the OOM killer would; every rank dies with it."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.timeout(120)
def test_a_killed_fork_server_is_the_cause_said_not_its_workers_exit_codes(monkeypatch, capfd):
    """Its workers die with it and multiprocessing then knows none of their exit codes (255 each): the job said "a
    rank exited with codes [255, 255]" and nothing of why."""
    from ignite_mgpu.processes import notebook

    monkeypatch.setattr(notebook, "interactive", lambda: False)  # a script: SystemExit, the lines on stderr
    with pytest.raises(SystemExit) as ended:
        launcher.launch(kills_its_server, nproc=2, backend="gloo")
    err = capfd.readouterr().err
    assert ended.value.code == 1, err
    assert (
        "ignite-mgpu: the fork server, which forks this job's workers, was killed by SIGKILL (the OOM killer, or a "
        "kill by hand), and every worker died with it. --max-restarts restarts the job on a new one; --resume auto "
        "continues from the last checkpoint.\n"
    ) in err, err
    assert "255" not in err and mp_forkserver._forkserver._forkserver_pid is None


@pytest.mark.timeout(60)
def test_a_server_kept_between_jobs_outlives_each_jobs_stop():
    """`ignite-mgpu scale` runs a job per size: inside kept_between_jobs the supervisor's stop at each job's end
    leaves the server up, and the next job's start finds it; leaving stops it."""
    with forkserver.kept_between_jobs():
        first = forkserver.start([forkserver.__name__])
        forkserver.stop()  # what each job's supervisor does at its end
        assert _state(first) not in ("Z", "gone")
        assert forkserver.start([forkserver.__name__]) == first  # the same server: nothing imported again
    assert mp_forkserver._forkserver._forkserver_pid is None and _state(first) == "gone"  # killed and waited for
