"""``ignite-mgpu scale``'s arithmetic (ignite_mgpu/runs/efficiency.py, runs/published.py, the sizes of
ignite_mgpu/scaling.py) on made-up epoch lines: speed-up and efficiency, the lost time per part summing to the
time beyond perfect scaling, the verdict's words per cause, the table, and the published figure nearest to a run.
`python -m pytest tests/runs/test_efficiency.py -q`."""

import math

import pytest

from ignite_mgpu.runs import efficiency, published
from ignite_mgpu.runs.efficiency import Size
from ignite_mgpu.scaling import sizes_up_to


def line(step, data, compute, comm, optimizer, batch, bound_by=None):
    """An epoch's line as metrics.jsonl has it, for ``len(data)`` ranks."""
    return {
        "processes": len(data),
        "time_per_iter_ms": step,
        "samples_per_s": batch * 1000 / step,
        "time_data_ms": data,
        "time_compute_ms": compute,
        "time_comm_ms": comm,
        "time_optimizer_ms": optimizer,
        "bound_by": bound_by,
    }


ONE = Size.from_line(1, 32, line(10.0, [1.0], [8.0], [0.0], [0.5], batch=32))


def test_speedup_and_efficiency_from_samples_per_second():
    two = Size.from_line(2, 64, line(12.5, [1.0, 1.0], [8.0, 8.0], [2.5, 2.5], [0.5, 0.5], batch=64))
    assert efficiency.speedup(ONE, two) == pytest.approx(1.6)
    assert efficiency.efficiency(ONE, two) == pytest.approx(0.8)


@pytest.mark.parametrize("batch", [64, 32])  # the batch per process kept (weak scaling), or the global one (strong)
def test_the_lost_parts_sum_to_the_time_beyond_perfect_scaling(batch):
    two = Size.from_line(2, batch, line(14.0, [1.5, 0.9], [9.0, 8.4], [2.0, 3.1], [0.6, 0.5], batch=batch))
    lost = efficiency.losses(ONE, two)
    ideal = ONE.split.step_ms * two.per_device / ONE.per_device
    assert sum(lost.values()) == pytest.approx(two.split.step_ms - ideal)
    assert lost["communication"] == pytest.approx(2.0)  # the rank that waits least: the all-reduce itself
    assert lost["waiting"] == pytest.approx(0.55)  # the other rank's extra: waiting for a slower one
    # Identical to 1 - efficiency of the step: the same time lost, seen from the throughput.
    assert sum(lost.values()) / two.split.step_ms == pytest.approx(1 - efficiency.efficiency(ONE, two))


def test_a_communication_bound_size_says_so_with_what_helps():
    two = Size.from_line(2, 64, line(20.0, [1.0, 1.0], [8.0, 8.0], [10.0, 10.5], [0.5, 0.5], batch=64))
    said = efficiency.verdict(ONE, two, "cuda")
    assert said.startswith("2 GPUs: 1.00x the samples/s of 1 (50% scaling efficiency); the time lost is mostly the ")
    assert "gradient all-reduce not hidden behind backward (10.0 ms of the 20.0 ms step)" in said
    assert "gradient accumulation (train.grad_accum_steps), or GPUs linked by NVLink would help" in said


def test_cpu_processes_sharing_the_cores_are_said_to_share_them():
    two = Size.from_line(2, 64, line(19.0, [1.0, 1.0], [16.0, 16.0], [1.0, 1.0], [0.5, 0.5], batch=64))
    said = efficiency.verdict(ONE, two, "cpu")
    assert "2 processes:" in said and "forward and backward, slower than on one process (8.0 ms" in said
    assert "the processes share the machine's cores" in said


def test_a_slow_rank_is_named_with_its_cause_when_the_others_wait_for_it():
    two = Size.from_line(2, 64, line(30.0, [1.0, 20.0], [8.0, 8.0], [20.0, 1.0], [0.5, 0.5], batch=64))
    said = efficiency.verdict(ONE, two, "cpu")
    assert "mostly waiting in the all-reduce for a slower rank" in said
    assert "rank 1 is the slowest: it waits 67% of its steps for data" in said


def test_a_size_that_scales_well_names_no_loss():
    two = Size.from_line(2, 64, line(10.5, [1.0, 1.0], [8.0, 8.0], [0.4, 0.5], [0.5, 0.5], batch=64))
    assert (
        efficiency.verdict(ONE, two, "cuda")
        == "2 GPUs: 1.90x the samples/s of 1 (95% scaling efficiency): it scales well"
    )


def test_fsdp_sizes_name_their_all_gathers():
    two = Size.from_line(2, 64, line(20.0, [1.0, 1.0], [8.0, 8.0], [10.0, 10.5], [0.5, 0.5], batch=64), sharded=True)
    said = efficiency.verdict(ONE, two, "cuda")
    assert "mostly FSDP's all-gathers of the parameters not hidden behind compute (10.0 ms" in said
    assert "model.fsdp_reshard_after_forward=false" in said
    lines = efficiency.table([ONE, two], "cuda").splitlines()
    assert "all-gather" in lines[0] and lines[-1].endswith("all-gather: the wait for it)")


def test_the_table_has_a_line_per_size_and_marks_an_all_reduce_not_measured():
    dp = Size.from_line(2, 64, line(12.0, [1.0, 1.0], [10.0, 10.0], [None, None], [0.5, 0.5], batch=64))
    assert not dp.comm_measured and dp.mean("comm") == 0.0
    lines = efficiency.table([ONE, dp], "cpu").splitlines()
    assert lines[0].split()[:5] == ["processes", "batch", "samples/s", "speed-up", "efficiency"]
    assert lines[1].split()[:5] == ["1", "32", "3200", "1.00x", "100%"]
    assert lines[2].split()[:7] == ["2", "64", "5333", "1.67x", "83%", "10.00", "-"]
    rows = efficiency.as_json([ONE, dp])
    assert rows[1]["efficiency"] == pytest.approx(5333.333 / 3200 / 2, abs=1e-4)
    assert set(rows[1]["lost_ms"]) == set(efficiency.PARTS)


@pytest.mark.parametrize(
    ("nvlink", "mixed", "gpus", "per_gpu", "expected"),
    [
        (False, True, 2, 64, "ResNet-50 on RTX 3090s over PCIe, TensorFlow, fp16, 64 images per GPU: 1.78x on 2 GPUs"),
        (False, False, 3, 300, "256 images per GPU: 3.61x on 4 GPUs (90%)"),  # the nearest batch, then count
        (True, False, 4, 128, "DGX A100 (A100 80GB, NVSwitch), PyTorch, TF32: 7.72x on 8 GPUs (96%)"),
        (True, True, 8, 256, "mixed precision: 6.72x on 8 GPUs (84%)"),
    ],
)
def test_the_published_figure_nearest_to_a_run(nvlink, mixed, gpus, per_gpu, expected):
    assert expected in published.nearest(nvlink, mixed, gpus, per_gpu)


def test_one_gpu_has_no_published_scaling():
    assert published.nearest(True, True, 1, 64) is None


def test_the_sizes_measured():
    assert sizes_up_to(1) == [1]
    assert sizes_up_to(3) == [1, 2, 3]
    assert sizes_up_to(8) == [1, 2, 4, 8]
    assert sizes_up_to(6) == [1, 2, 4, 6]
    assert not any(math.isnan(v) for v in efficiency.losses(ONE, ONE).values())
