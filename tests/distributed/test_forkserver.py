"""The fork server (processes/forkserver.py), in one 2-process gloo job run by launch() in this process: workers
forked from a server that imported torch, the supervisor's environment (set after the server started) in the
workers, CUDA untouched there, a DataLoader with a worker process, and a rank's SIGKILL restarted at once by the same
server, stopped when the job ends. `python -m pytest tests/distributed/test_forkserver.py`."""

from __future__ import annotations

import json
import os
import signal
import sys
from multiprocessing import forkserver as mp_forkserver
from pathlib import Path

import pytest

from ignite_mgpu.processes import forkserver, launcher

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
    result = launcher.launch(job, str(tmp_path), nproc=2, backend="gloo", max_restarts=1)

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
