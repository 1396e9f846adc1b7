"""Lending (gpus/lending.py): what an elastic job gives the line of waiting jobs and takes back, pure (``change_for``),
and what it reads of a real claims folder (``look``). The supervisor's side is tests/processes/test_lender.py, a real
lending job on the stand-in tests/distributed/test_elastic.py.

Run: python -m pytest tests/gpus/test_lending.py -q
"""

from __future__ import annotations

import os

from ignite_mgpu.gpus import claims, holders, waiting
from ignite_mgpu.gpus.holders import Holder
from ignite_mgpu.gpus.inventory import GpuInfo
from ignite_mgpu.gpus.lending import Change, Line, change_for, look
from ignite_mgpu.gpus.waiting import Waiter

G = [f"GPU-{i}" for i in range(8)]  # claim names


def any_of(count: int, pid: int = 1) -> Waiter:
    return Waiter(Holder("bob", pid, known=True), None, count)


def named(*ids: int, pid: int = 2) -> Waiter:
    return Waiter(Holder("carol", pid, known=True), [G[i] for i in ids], len(ids))


def line(*waiters: Waiter, free=(), coming=()) -> Line:
    return Line(tuple(G[i] for i in free), tuple(G[i] for i in coming), waiters)


HELD = G[:4]  # the elastic job holds GPU 0-3, on auto:2-4


def test_a_waiter_gets_the_gpus_above_min_that_the_free_ones_lack_the_last_ones_first():
    change = change_for(HELD, 2, 4, line(any_of(2)))
    assert change == Change(lend=(G[3], G[2]), to=(Holder("bob", 1, known=True),))
    # One free GPU: only one more is lent.
    assert change_for(HELD, 2, 4, line(any_of(2), free=[5])).lend == (G[3],)
    # Enough free GPUs, or GPUs another job is lending: nothing is lent, and nothing is taken while anyone waits.
    assert not change_for(HELD, 2, 4, line(any_of(2), free=[5, 6]))
    assert not change_for(HELD, 2, 4, line(any_of(2), coming=[5, 6]))


def test_never_below_min_and_never_for_a_waiter_that_could_not_start_anyway():
    assert not change_for(HELD, 3, 4, line(any_of(2)))  # only one above MIN 3: the waiter needs 2
    assert not change_for(HELD, 4, 4, line(any_of(1)))  # at MIN
    assert change_for(HELD, 3, 4, line(any_of(2), free=[5])).lend == (G[3],)


def test_the_line_order_holds_an_unservable_auto_waiter_keeps_the_later_ones_waiting():
    assert not change_for(HELD, 2, 4, line(any_of(3), any_of(1, pid=3)))
    # Served in order: the first takes the free GPU, the second gets one lent.
    assert change_for(HELD, 2, 4, line(any_of(1), any_of(1, pid=3), free=[5])).lend == (G[3],)


def test_a_waiter_naming_gpus_gets_those_of_this_job_and_no_later_waiter_gets_them():
    assert change_for(HELD, 2, 4, line(named(1))).lend == (G[1],)
    assert change_for(HELD, 2, 4, line(named(1, 5), free=[5])).lend == (G[1],)
    # It also needs GPU 6, which is nobody's to give: nothing is lent, and GPU 1 stays out of a later waiter's reach.
    assert change_for(HELD, 2, 4, line(named(1, 6), any_of(1, pid=3))).lend == (G[3],)
    assert not change_for(HELD, 2, 4, line(named(0, 1, 2)))  # would leave 1, below MIN 2


def test_free_gpus_are_taken_up_to_max_only_when_nobody_waits():
    assert change_for(G[:2], 2, 4, line(free=[4, 5, 6])) == Change(take=(G[4], G[5]))
    assert not change_for(HELD, 2, 4, line(free=[4, 5]))  # at MAX
    assert not change_for(G[:2], 2, 4, line(any_of(3), free=[4, 5]))  # the free ones are the waiter's
    assert change_for(G[:2], 2, 4, line(free=[4, 5, 6]), avoid=frozenset({G[4]})).take == (G[5], G[6])


def test_look_reads_free_gpus_the_line_and_what_another_elastic_job_lends():
    snapshot = [
        GpuInfo(i, f"00000000:{i:02X}:00.0", "A100", 1 if i != 3 else 70000, 81920, 0, 0 if i != 2 else 1, uuid=G[i])
        for i in range(5)
    ]  # GPU 2 runs a process, GPU 3's memory is used: neither is free
    fd = claims.open_dir(claims.claims_dir(), create=True)
    assert fd is not None
    held = claims.claim(fd, [G[0], G[1]], "1-2")
    assert held is not None
    ticket = waiting.Ticket(fd, None, count=2)
    try:
        held.rewrite(claims.holder_record("1-2", [G[1]], held.since))  # it lends GPU 1
        seen = look(fd, snapshot, 0.5)
        assert seen.free == (G[4],) and seen.coming == (G[1],) and seen.claimed == {G[0], G[1]}
        assert [(w.wants, w.count, w.who.pid) for w in seen.waiters] == [(None, 2, os.getpid())]
        assert holders.holders(fd, [G[0]])[G[0]].lent == (G[1],)
    finally:
        ticket.close()
        held.close()
        os.close(fd)
