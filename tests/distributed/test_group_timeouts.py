"""Every process group the package makes honours dist.timeout (torch gives a group made without ``timeout=`` its own
default, 30 minutes on gloo, whatever the job's group was given). In a 2-process gloo job (``launch(timeout=2)``)
rank 0 all-reduces alone on the sharded checkpoint writer's gloo group while rank 1 stays alive without joining:
gloo's timeout must end it in about 2 s. The source check that every group-making call passes ``stop.group_timeout()``
is tests/env/test_stop.py; the job's own group is checked by tests/faults/test_hangs.py (a first step that waits
past ``--timeout 5``). `python -m pytest tests/distributed/test_group_timeouts.py -q`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ignite_mgpu import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT = 2.0


def wait_alone(local_rank: int, out: str) -> tuple[float, str]:
    """Rank 0 all-reduces on the sharded writer's group, alone: (seconds until it failed, the error). Rank 1 stays
    alive until then (its socket open: only the timeout can end rank 0's wait), at most 20 s."""
    import torch
    import torch.distributed as dist

    from ignite_mgpu.checkpoint.sharded import ShardedCheckpoint

    group = ShardedCheckpoint({}, out, 1, async_save=True)._group  # made on every rank, as a job makes it
    done = Path(out, "done")
    if dist.get_rank() == 1:
        deadline = time.monotonic() + 20
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0.0, ""  # both ranks then meet in the job's closing barrier
    start = time.monotonic()
    try:
        dist.all_reduce(torch.zeros(1), group=group)
        ended = "returned"
    except RuntimeError as err:
        ended = str(err)
    seconds = time.monotonic() - start
    done.touch()
    return seconds, ended


@pytest.mark.timeout(120)
def test_a_side_groups_collective_ends_on_dist_timeout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a failed job's hang report goes to the working directory
    seconds, error = launch(wait_alone, str(tmp_path), nproc=2, backend="gloo", timeout=TIMEOUT)
    assert "Timed out" in error, error
    assert TIMEOUT * 0.8 <= seconds < TIMEOUT + 4, (seconds, error)
