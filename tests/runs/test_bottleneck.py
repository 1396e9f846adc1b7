"""The judging rule of where the step's time goes (ignite_mgpu/runs/bottleneck.py) on made-up numbers: a slow rank
named with its cause, a job bound by data or by communication, nothing said when nothing stands out, each threshold
at its edge. `python -m pytest tests/runs/test_bottleneck.py -q`."""

import math

import pytest

from ignite_mgpu.runs.bottleneck import BOUND_SHARE, SLOWER_SHARE, Split, judge, slowest_rank


def split(data, compute, comm, optimizer=None, step=None):
    optimizer = optimizer or [1.0] * len(data)
    waits = [0.0 if math.isnan(w) else w for w in comm]
    step = step or max(d + c + w + o for d, c, w, o in zip(data, compute, waits, optimizer, strict=True))
    return Split(data, compute, comm, optimizer, step)


def test_a_rank_slow_at_its_data_is_named_and_the_others_wait_for_it():
    # Rank 1 waits 45 ms for data; rank 0 computes and waits 44 ms for it in the all-reduce.
    verdict = judge(split(data=[1, 45], compute=[50, 50], comm=[48, 4]))
    assert verdict.slowest_rank == 1 and verdict.bound_by == "slowest_rank"
    assert verdict.words == (
        "rank 1 is the slowest: it waits 45% of its steps for data (raise data.num_workers, or look at its node's "
        "storage); the other ranks wait for it in the all-reduce (48% of their step)"
    )


def test_a_rank_slow_at_its_compute_is_named_against_the_others_median():
    verdict = judge(split(data=[1, 1, 1, 1], compute=[40, 40, 80, 41], comm=[45, 44, 4, 43]))
    assert verdict.slowest_rank == 2 and verdict.bound_by == "slowest_rank"
    assert verdict.words.startswith("rank 2 is the slowest: its forward and backward take 80.0 ms against 40.0 ms")


def test_a_balanced_job_bound_by_communication_counts_the_rank_that_waits_least():
    verdict = judge(split(data=[1, 1], compute=[30, 31], comm=[62, 60]))
    assert verdict.bound_by == "communication" and verdict.slowest_rank == 1
    assert verdict.words.startswith("bound by communication: the gradient all-reduce not hidden behind backward takes")
    assert "(a larger batch per GPU, gradient accumulation (train.grad_accum_steps), or GPUs linked by NVLink" in (
        verdict.words
    )
    # FSDP: its all-gathers are the communication, and its resharding one more way out.
    fsdp = Split([1, 1], [30, 31], [62, 60], [1, 1], 94, sharded=True)
    assert judge(fsdp).words.startswith("bound by communication: FSDP's all-gathers of the parameters not hidden")
    assert "model.fsdp_reshard_after_forward=false (no gathers in backward, more memory), or GPUs linked" in (
        judge(fsdp).words
    )
    slow = judge(Split([1, 45], [50, 50], [48, 4], [1, 1], 100, sharded=True)).words
    assert "the other ranks wait for it in the all-gathers" in slow
    # CPU processes: no GPU to link; the batch per process and accumulation help.
    on_cpu = judge(split(data=[1, 1], compute=[30, 31], comm=[62, 60]), "cpu").words
    assert on_cpu.endswith("(a larger batch per process or gradient accumulation (train.grad_accum_steps) would help)")


def test_a_balanced_job_bound_by_data_and_one_process():
    assert judge(split(data=[40, 41], compute=[50, 50], comm=[1, 1])).bound_by == "data"
    one = judge(split(data=[60], compute=[40], comm=[0.0]))
    assert one.slowest_rank is None and one.bound_by == "data" and one.words.startswith("bound by data: the ranks wait")


def test_nothing_is_said_when_nothing_stands_out():
    verdict = judge(split(data=[1, 2], compute=[80, 82], comm=[10, 8]))
    assert verdict.bound_by is None and verdict.words == "" and verdict.slowest_rank == 1


def test_the_thresholds_at_their_edges():
    step = 100.0
    just = SLOWER_SHARE * step
    assert judge(split([0, just], [50, 50], [0, 0], [0, 0], step)).bound_by == "slowest_rank"
    assert judge(split([0, just - 0.5], [50, 50], [0, 0], [0, 0], step)).bound_by is None
    bound = BOUND_SHARE * step
    assert judge(split([0, 0], [50, 50], [bound, bound], [0, 0], step)).bound_by == "communication"
    assert judge(split([0, 0], [50, 50], [bound - 0.5, bound], [0, 0], step)).bound_by is None


def test_an_unmeasured_wait_counts_as_no_communication():
    nan = math.nan
    verdict = judge(split(data=[1, 1], compute=[80, 80], comm=[nan, nan]))
    assert verdict.bound_by is None
    slow = judge(split(data=[1, 60], compute=[20, 20], comm=[nan, nan], step=100))
    assert slow.words.endswith("the other ranks wait for it in the all-reduce")


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_slowest_rank_is_the_most_own_work(ranks):
    data = [float(r == ranks - 1) * 10 for r in range(ranks)]
    expected = None if ranks == 1 else ranks - 1
    assert slowest_rank(split(data, [5.0] * ranks, [50.0] * ranks)) == expected
