"""An elastic job's side of lending (processes/resize.py): the plan on the new GPUs (processes, backend, threads, CPU
binding), which jobs lend, and the looks of a Lender at a real claims folder with the 4-GPU stand-in nvidia-smi.
The decision itself is tests/gpus/test_lending.py.

Run: python -m pytest tests/processes/test_resize.py -q
"""

from __future__ import annotations

import os

import pytest

from ignite_mgpu.cpus.binding import BindingPlan, plan_for_job
from ignite_mgpu.gpus import claims, waiting
from ignite_mgpu.gpus.ranges import GpuRange
from ignite_mgpu.processes import resize
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.processes.resize import Lender, lends, with_gpus
from tests.gpus.test_claims import TABLE, UUID, fake_gpus  # noqa: F401  (a fixture)

G = [claims.claim_name(UUID(i), "") for i in range(4)]  # the stand-in's GPUs by claim name


def plan_on(gpus: list[int], backend: str | None = "gloo", strategy: str = "ddp") -> LaunchPlan:
    names = {i: G[i] for i in gpus}
    return LaunchPlan(backend, len(gpus) if strategy != "dp" else 1, gpus=gpus, gpu_names=names, strategy=strategy,
                      gpu_range=GpuRange(1, 4), env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))},
                      cpu_share=8, binding=BindingPlan())  # fmt: skip


@pytest.mark.parametrize(
    "start, backend, to, want",
    [
        ([0], None, {0: G[0], 3: G[3]}, (2, "gloo", "0,3", "4")),  # grows from one process: the group's backend
        ([0, 1, 2], "gloo", {1: G[1]}, (1, None, "1", "8")),  # one process needs no group
    ],
)
def test_with_gpus_plans_the_processes_backend_and_threads_of_the_new_gpus(start, backend, to, want):
    new = with_gpus(plan_on(start, backend), to)
    assert (new.nproc, new.backend, new.env["CUDA_VISIBLE_DEVICES"], new.env["OMP_NUM_THREADS"]) == want
    assert new.gpus == sorted(to) and new.gpu_names == to
    assert with_gpus(plan_on([0, 1], strategy="dp"), {0: G[0], 1: G[1], 2: G[2]}).nproc == 1


def test_only_the_default_job_on_a_range_with_claims_lends():
    fd = claims.open_dir(claims.claims_dir(), create=True)
    assert fd is not None
    try:
        elastic = plan_on([0, 1])
        assert not lends(elastic, True)  # no claims: --share, or nothing claimed
        held = claims.claim(fd, [G[0]])
        assert held is not None
        with held:
            elastic.claims = held
            assert lends(elastic, True) and not lends(elastic, False)  # False: no restart hook (launch(), a script)
            elastic.gpu_range = None
            assert not lends(elastic, True)
    finally:
        os.close(fd)


def test_with_gpus_binds_the_new_number_of_processes_again():
    start = plan_on([0, 1])
    start.device = "cpu"  # the CPU topology only: no GPU snapshot to read here
    start.binding = plan_for_job("cores", 2, [0, 1], False, "ddp", {}, allowed={0, 1})
    assert start.binding.mode == "cores" and len(start.binding.ranks) == 2
    smaller = with_gpus(start, {0: G[0]})
    assert smaller.binding.mode == "cores" and len(smaller.binding.ranks) == 1


@pytest.fixture
def elastic_job(fake_gpus):  # noqa: F811
    """A job on auto:2-4 holding GPU 0,1 of the 4 idle GPUs of the stand-in, and its claims folder's fd."""
    (fake_gpus / "gpus.csv").write_text(TABLE.replace("71680", "1").replace("40960", "1"))
    (fake_gpus / "apps.csv").write_text("")
    fd = claims.open_dir(claims.claims_dir(), create=True)
    assert fd is not None
    held = claims.claim(fd, G[:2], "2-4")
    assert held is not None
    job = plan_on([0, 1])
    job.gpu_range, job.claims = GpuRange(2, 4), held
    yield job, fd
    held.close()
    os.close(fd)


def test_a_lender_lends_to_a_waiter_at_once_and_takes_free_gpus_seen_twice_never_a_failed_one(elastic_job, monkeypatch):
    job, fd = elastic_job
    monkeypatch.setattr(resize, "LOOK_EVERY", 0.0)
    lender = Lender(job)
    lender.failed.add(G[2])  # left out after a failure: never taken again
    assert lender.look(job, 0.0) is None  # GPU 3 is free: seen once
    taking = lender.look(job, 0.0)
    assert taking is not None and taking.change.take == (G[3],) and taking.names == {0: G[0], 1: G[1], 3: G[3]}
    assert set(job.claims.names) == {G[0], G[1], G[3]}  # claimed before the workers stop
    job = with_gpus(job, taking.names)
    ticket = waiting.Ticket(fd, None, count=2)  # a job waits for any 2: GPU 2 is free, one more is lent
    try:
        lending = lender.look(job, 0.0)
        assert lending is not None and lending.change.lend == (G[3],) and lending.names == {0: G[0], 1: G[1]}
        assert claims.holders(fd, [G[0]])[G[0]].lent == (G[3],)  # what devices shows, and other lenders count
    finally:
        ticket.close()
    lender.cancel(job, lending)  # the change did not happen: nothing is lent
    assert claims.holders(fd, [G[0]])[G[0]].lent == ()


def test_a_lender_at_max_with_nobody_waiting_asks_nothing_of_nvidia_smi(elastic_job, monkeypatch):
    job, _ = elastic_job
    job.gpu_range = GpuRange(1, 2)
    monkeypatch.setattr(resize.inventory, "query_gpus", lambda: pytest.fail("nvidia-smi asked"))
    assert Lender(job).look(job, 0.0) is None
