"""A CUDA worker forked by the fork server (launch/forkserver.py): the server imported torch without starting
CUDA, so the worker starts it on its GPU, pins a DataLoader's batches, and does the same again after a restart by
the same server. `python -m pytest -m gpu tests/gpu/test_forkserver_cuda.py`; skips without a GPU."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ignite_mgpu.processes import forkserver, launcher
from tests.conftest import needs_gpus, run_fresh

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # they start processes: not in the fast tier


def cuda_job(local_rank: int, folder: str) -> dict:
    import torch
    from torch.utils.data import DataLoader

    started_fresh = not torch.cuda.is_initialized() and not torch.cuda._is_in_bad_fork()
    loader = DataLoader(torch.arange(8.0), batch_size=4, num_workers=1, pin_memory=True)
    total = sum(batch.to("cuda", non_blocking=True).sum() for batch in loader)
    marker = Path(folder, "killed")
    if not marker.exists():  # the first attempt dies after using CUDA; the restart forks from the same server
        marker.write_text(str(os.getppid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return {
        "started_fresh": started_fresh,
        "total": float(total.item()),
        "device": torch.cuda.get_device_name(0),
        "parents": [int(marker.read_text()), os.getppid()],
    }


def launched(folder: str) -> dict:
    """The job launched, in the fresh interpreter of ``run_fresh``: its result and the fork servers started."""
    servers = []
    start = forkserver.start

    def noted(*args, **kwargs):
        servers.append(start(*args, **kwargs))
        return servers[-1]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(forkserver, "start", noted)
        result = launcher.launch(cuda_job, folder, gpus="0", max_restarts=1)
    return {**result, "servers": servers}


@pytest.mark.timeout(300)
def test_a_cuda_worker_forked_by_the_server_and_restarted(tmp_path):
    needs_gpus(1)
    # In a fresh process: CUDA started in this one by an earlier test would make launch(gpus="0") refuse.
    result, stderr = run_fresh("tests.gpu.test_forkserver_cuda:launched", str(tmp_path), timeout=280)
    assert result["started_fresh"] and result["total"] == 28.0 and result["device"]
    assert result["parents"] == [result["servers"][0]] * 2  # both attempts forked by the one server
    assert "at once (one rank died)" in stderr
