"""An elastic job's side of lending (processes/elastic.py): the plan on the new GPUs (``LaunchPlan.on_gpus``:
processes, backend, threads, CPU binding), which jobs lend, and the looks of a Lender at a real claims folder with
the 4-GPU stand-in nvidia-smi.
The decision itself is tests/gpus/test_lending.py.

Run: python -m pytest tests/processes/test_lender.py -q
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from ignite_mgpu.cpus.binding import BindingPlan, plan_for_job
from ignite_mgpu.gpus import claims, holders, waiting
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.gpus.ranges import GpuRange
from ignite_mgpu.processes import elastic
from ignite_mgpu.processes.elastic import Lender, lends
from ignite_mgpu.processes.plan import LaunchPlan
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
        ([0], None, {0: G[0], 3: G[3]}, (2, "gloo", f"{G[0]},{G[3]}", "4")),  # grows from one: the group's backend
        ([0, 1, 2], "gloo", {1: G[1]}, (1, None, G[1], "8")),  # one process needs no group
    ],
)
def test_on_gpus_plans_the_processes_backend_and_threads_of_the_new_gpus(start, backend, to, want):
    new = plan_on(start, backend).on_gpus(to)
    assert (new.nproc, new.backend, new.env["CUDA_VISIBLE_DEVICES"], new.env["OMP_NUM_THREADS"]) == want
    assert new.gpus == sorted(to) and new.gpu_names == to
    assert plan_on([0, 1], strategy="dp").on_gpus({0: G[0], 1: G[1], 2: G[2]}).nproc == 1
    assert plan_on([0]).on_gpus({0: "pci-00000000_07_00.0", 2: G[2]}).env["CUDA_VISIBLE_DEVICES"] == f"0,{G[2]}"


def test_only_the_default_job_on_a_range_with_claims_lends():
    fd = claims.open_dir(claims.claims_dir(), create=True)
    assert fd is not None
    try:
        on_range = plan_on([0, 1])
        assert not lends(on_range, GpuClaims(), True)  # no claims: --share, or nothing claimed
        held = claims.claim(fd, [G[0]])
        assert held is not None
        with held:
            # False: no restart hook (launch(), a script)
            assert lends(on_range, held, True) and not lends(on_range, held, False)
            assert not lends(dataclasses.replace(on_range, gpu_range=None), held, True)
    finally:
        os.close(fd)


def test_on_gpus_binds_the_new_number_of_processes_again():
    binding = plan_for_job("cores", 2, [0, 1], False, "ddp", {}, allowed={0, 1})
    start = dataclasses.replace(plan_on([0, 1]), device="cpu", binding=binding)  # the CPU topology only: no snapshot
    assert start.binding.mode == "cores" and len(start.binding.ranks) == 2
    smaller = start.on_gpus({0: G[0]})
    assert smaller.binding.mode == "cores" and len(smaller.binding.ranks) == 1


@pytest.fixture
def elastic_job(fake_gpus):  # noqa: F811
    """A job on auto:2-4 holding GPU 0,1 of the 4 idle GPUs of the stand-in, its claims, and its claims folder's fd."""
    (fake_gpus / "gpus.csv").write_text(TABLE.replace("71680", "1").replace("40960", "1"))
    (fake_gpus / "apps.csv").write_text("")
    fd = claims.open_dir(claims.claims_dir(), create=True)
    assert fd is not None
    held = claims.claim(fd, G[:2], "2-4")
    assert held is not None
    job = dataclasses.replace(plan_on([0, 1]), gpu_range=GpuRange(2, 4))
    yield job, held, fd
    held.close()
    os.close(fd)


def test_a_lender_lends_to_a_waiter_at_once_and_takes_free_gpus_seen_twice_never_a_failed_one(elastic_job, monkeypatch):
    job, held, fd = elastic_job
    monkeypatch.setattr(elastic, "LOOK_EVERY", 0.0)
    lender = Lender(held, "2-4")
    lender.failed.add(G[2])  # left out after a failure: never taken again
    assert lender.look(job, 0.0) is None  # GPU 3 is free: seen once
    taking = lender.look(job, 0.0)
    assert taking is not None and taking.change.take == (G[3],) and taking.names == {0: G[0], 1: G[1], 3: G[3]}
    assert set(held.names) == {G[0], G[1], G[3]}  # claimed before the workers stop
    job = job.on_gpus(taking.names)
    ticket = waiting.Ticket(fd, None, count=2)  # a job waits for any 2: GPU 2 is free, one more is lent
    try:
        lending = lender.look(job, 0.0)
        assert lending is not None and lending.change.lend == (G[3],) and lending.names == {0: G[0], 1: G[1]}
        assert holders.holders(fd, [G[0]])[G[0]].lent == (G[3],)  # what devices shows, and other lenders count
    finally:
        ticket.close()
    lender.cancel(lending)  # the change did not happen: nothing is lent
    assert holders.holders(fd, [G[0]])[G[0]].lent == ()


def test_a_lender_at_max_with_nobody_waiting_asks_nothing_of_nvidia_smi(elastic_job, monkeypatch):
    job, held, _ = elastic_job
    job = dataclasses.replace(job, gpu_range=GpuRange(1, 2))
    monkeypatch.setattr(elastic.inventory, "query_gpus", lambda: pytest.fail("nvidia-smi asked"))
    assert Lender(held, "1-2").look(job, 0.0) is None


def test_a_lender_takes_back_no_more_than_the_range_cut_to_the_data_allows(elastic_job, monkeypatch):
    """auto:2-4 with a batch of 3 is planned as auto:2-3 (jobs.range_within_the_data): with GPU 2 and 3 free, the job
    on 2 takes one of them, not both (it died of the batch split over 4)."""
    job, held, _ = elastic_job
    job = dataclasses.replace(job, gpu_range=GpuRange(2, 3))
    monkeypatch.setattr(elastic, "LOOK_EVERY", 0.0)
    lender = Lender(held, "2-3")
    assert lender.look(job, 0.0) is None  # seen free once
    taking = lender.look(job, 0.0)
    assert taking is not None and taking.change.take == (G[2],) and sorted(taking.names) == [0, 1, 2]
    lender.cancel(taking)
