"""A claims folder flooded with foreign files: the names that matter (holder files, waiting tickets) are filtered
before any cap, so a live holder is still named and the waiting line still holds. `python -m pytest tests/hostile`."""

from __future__ import annotations

import os

import pytest

from ignite_mgpu.gpus import claims, holders, shared_dir, waiting

GPU = "GPU-8a0e0000-0000-0000-0000-000000000001"


@pytest.fixture
def flooded():
    path = claims.claims_dir()
    fd = claims.open_dir(path, create=True)
    for i in range(shared_dir.MAX_ENTRIES + 50):  # sorted before "GPU-" and "wait-"
        os.close(os.open(f"0-foreign-{i:05d}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    yield fd
    os.close(fd)


def test_a_live_holder_is_named_beside_any_number_of_other_files(flooded):
    held = claims.claim(flooded, [GPU])
    assert held is not None
    with held:
        who = holders.holders(flooded, [GPU])[GPU]
        assert "unknown job" not in who.describe() and who.pid == os.getpid()


def test_the_waiting_line_holds_beside_any_number_of_other_files(flooded):
    first = waiting.Ticket(flooded, [GPU])
    second = waiting.Ticket(flooded, None, count=2)
    try:
        ahead = second.ahead()
        assert [(w.who.pid, w.wants, w.count) for w in ahead] == [(os.getpid(), [GPU], 1)]
        assert [(w.wants, w.count) for w in waiting.waiting(flooded)] == [([GPU], 1), (None, 2)]
        assert first.ahead() == []
    finally:
        second.close()
        first.close()
