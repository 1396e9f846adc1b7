"""The hang report on NCCL (docs/how-to/hangs.md), on two real GPUs: `python -m pytest -m gpu`. Rank 1 sleeps in
its forward (tests/faults/faultmod.py) while rank 0 waits in NCCL: the hang watch (or dist.timeout, the Flight
Recorder dumping on the watchdog's timeout) ends the job with rank 1's frame, each rank's physical GPU and the
Flight Recorder's collective that did not complete; its dumps are copied beside the report."""

from __future__ import annotations

import os
import re

import pytest

from tests.conftest import REPO, needs_gpus, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
FAULTS = REPO / "tests" / "faults"
ARGS = ["train", "--nproc", "2", "--backend", "nccl", "model.name=faultmod:make", "data.train_size=640",
        "data.batch_size=64", "train.check_every=1", "train.progress_bar=false",
        "checkpoint.every_iters=0"]  # fmt: skip
ENV = {"FAULT": "sleep:1:3", "PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}"}


def assert_report(stderr: str, out) -> None:
    assert re.search(r"rank 1 \(pid \d+, physical GPU \d+.*\) is in \S*faultmod\.py:\d+ in forward", stderr), stderr
    assert re.search(r"rank 0 \(pid \d+, physical GPU \d+.*NCCL Flight Recorder: nccl:\S+ #\d+ .*not completed", stderr)
    assert len(list(out.glob("hang_*.txt"))) == 1, sorted(p.name for p in out.iterdir())
    assert list(out.glob("nccl_trace_*/nccl_trace_rank_0")), sorted(p.name for p in out.iterdir())


@pytest.mark.timeout(300)
def test_nccl_hang_found_by_the_watch_names_the_rank_and_the_pending_collective(tmp_path):
    needs_gpus(2)
    out = tmp_path / "run"
    result = run_cli([*ARGS, "dist.hang_seconds=10", "--output-dir", str(out)], tmp_path, timeout=200, env=ENV)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "the job hung: no rank made progress" in result.stderr, result.stderr[-3000:]
    assert_report(result.stderr, out)


@pytest.mark.timeout(300)
def test_nccl_timeout_reads_the_flight_recorders_dump(tmp_path):
    needs_gpus(2)
    out = tmp_path / "run"
    args = [*ARGS, "dist.hang_seconds=0", "--timeout", "20", "--output-dir", str(out)]
    result = run_cli(args, tmp_path, timeout=200, env=ENV)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Where each rank was" in result.stderr, result.stderr[-3000:]
    assert_report(result.stderr, out)
