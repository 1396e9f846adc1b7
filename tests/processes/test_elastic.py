"""Leaving out a failed GPU, pure: which of a job's GPUs failed (gpus/health.py: gone from nvidia-smi, reported lost,
a rank's CUDA device error), the restart's plan on the GPUs left (processes/elastic.py: not below MIN) and the
message of a job without a range. The real restart on the stand-in is tests/distributed/test_elastic.py.

Run: python -m pytest tests/processes/test_elastic.py -q
"""

import pytest

from ignite_mgpu.gpus import health
from ignite_mgpu.gpus.claims import claim_name
from ignite_mgpu.gpus.health import device_error
from ignite_mgpu.gpus.inventory import GpuInfo, query_gpus
from ignite_mgpu.gpus.ranges import GpuRange
from ignite_mgpu.processes.elastic import leave_out
from ignite_mgpu.processes.plan import LaunchPlan
from tests.gpus.test_claims import TABLE, fake_gpus  # noqa: F401  (a fixture)

UUID = "GPU-a1000000-0000-4000-8000-00000000000{}".format


def gpu(index: int, name: str = "NVIDIA A100-SXM4-80GB") -> GpuInfo:
    return GpuInfo(index, f"00000000:{7 + index:02X}:00.0", name, 1, 81920, 0, 0, uuid=UUID(index))


def plan(gpus=(0, 1, 2, 3), elastic: GpuRange | None = GpuRange(2, 4), strategy: str = "ddp") -> LaunchPlan:
    names = {i: claim_name(UUID(i), "") for i in gpus}
    return LaunchPlan("nccl", len(gpus), gpus=list(gpus), gpu_names=names, gpu_range=elastic, strategy=strategy,
                      env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "OMP_NUM_THREADS": "4"})  # fmt: skip


def lost_gpus(plan: LaunchPlan, failures: list[dict], snapshot: list[GpuInfo] | None) -> list[health.Lost]:
    """``health.lost_gpus`` over a plan's GPUs, as the restart asks it."""
    one_per_rank = plan.strategy != "dp"
    return health.lost_gpus(plan.gpus or [], plan.gpu_names, failures, snapshot, plan.first_rank, one_per_rank)


def failure(rank: int, message: str, at: float = 1.0) -> dict:
    return {"rank": rank, "time": at, "type": "RuntimeError", "message": message, "traceback": "", "code": 1}


@pytest.mark.parametrize(
    "text, phrase",
    [
        ("CUDA error: unspecified launch failure", "unspecified launch failure"),
        ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", "Xid"),
        ("the GPU has fallen off the bus", "fallen off the bus"),
        ("CUDA error: uncorrectable ECC error encountered", "uncorrectable ECC"),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", None),
        ("CUDA error: device-side assert triggered", None),  # a bug in the program, not the device
    ],
)
def test_device_errors_are_told_from_the_programs_own(text, phrase):
    assert device_error(text) == phrase


def test_a_gpu_gone_from_the_snapshot_or_reported_lost_or_named_by_a_ranks_error_is_lost():
    snapshot = [gpu(0), gpu(1, "[GPU is lost]"), gpu(3)]
    found = lost_gpus(plan(), [failure(3, "CUDA error: unspecified launch failure")], snapshot)
    assert [(x.physical_id, x.reason) for x in found] == [
        (1, "nvidia-smi reports it lost ([GPU is lost])"),
        (2, "nvidia-smi no longer lists it"),
        (3, "rank 3's error is a CUDA device error ('unspecified launch failure')"),
    ]
    # nvidia-smi failing altogether tells nothing; a plain error blames no GPU; dp cannot say which GPU it was
    assert lost_gpus(plan(), [failure(1, "RuntimeError: boom")], []) == []
    assert lost_gpus(plan(strategy="dp"), [failure(0, "fallen off the bus")], None) == []
    # ids moved in the snapshot: the GPU is found by its UUID
    moved = [GpuInfo(i, "", "NVIDIA A100", 1, 81920, 0, 0, uuid=UUID(j)) for i, j in enumerate((0, 1, 3))]
    assert [x.physical_id for x in lost_gpus(plan(), [], moved)] == [2]
    unnamed = LaunchPlan("nccl", 2, gpus=[0, 1])  # GPUs the plan knows no name of are never "no longer listed"
    assert lost_gpus(unnamed, [], [gpu(3)]) == []


def test_an_elastic_job_restarts_on_the_gpus_left_and_lets_go_of_the_failed_ones_claim():
    start = plan()
    change = leave_out(start, [], lambda: [gpu(0), gpu(1), gpu(3)])
    assert change is not None and change.refusal is None and change.plan is not None
    smaller = change.plan
    assert (smaller.gpus, smaller.nproc, smaller.backend) == ([0, 1, 3], 3, "nccl")
    # By UUID: after a GPU fell off the bus, the others' indices may not be CUDA's any more.
    assert smaller.env == {"CUDA_VISIBLE_DEVICES": ",".join(UUID(i) for i in (0, 1, 3)), "OMP_NUM_THREADS": "4"}
    assert smaller.gpu_range == GpuRange(2, 4)
    assert set(smaller.gpu_names) == {0, 1, 3} and change.released == [claim_name(UUID(2), "")]
    assert change.message == (
        "left out GPU 2 (nvidia-smi no longer lists it); its claim is released, and the restart continues on GPU "
        "0,1,3 (3 processes, was 4; --gpus auto:2-4)."
    )
    assert start.gpus == [0, 1, 2, 3] and start.nproc == 4  # the plan itself is left as it was
    one = leave_out(plan((0, 1), GpuRange(1, 2)), [failure(1, "Xid 79")], lambda: [gpu(0), gpu(1)])
    assert one is not None and one.plan is not None and (one.plan.nproc, one.plan.backend) == (1, None)


def test_never_below_min_and_without_a_range_the_line_says_a_range_would_have_continued():
    below = leave_out(plan(elastic=GpuRange(4, 4)), [], lambda: [gpu(0), gpu(1), gpu(3)])
    assert (
        below is not None
        and below.plan is None
        and below.refusal
        == ("GPU 2 (nvidia-smi no longer lists it) failed, leaving 3 GPUs, below the range's MIN 4 (--gpus auto:4-4)")
    )
    fixed = leave_out(plan(elastic=None), [], lambda: [gpu(0), gpu(1), gpu(3)])
    assert fixed is not None and fixed.plan is None and fixed.refusal is None
    assert fixed.message == (
        "failed: GPU 2 (nvidia-smi no longer lists it). The restart runs on the same GPUs; --gpus auto:3-4 would "
        "have continued on GPU 0,1,3 without it."
    )
    assert leave_out(plan(), [failure(0, "boom")], lambda: [gpu(i) for i in range(4)]) is None
    assert leave_out(LaunchPlan("gloo", 2), [failure(0, "Xid 79")], lambda: []) is None  # no GPUs chosen


def test_the_stand_in_can_lose_a_gpu_and_report_one_lost(fake_gpus):  # noqa: F811
    lines = TABLE.splitlines()
    lost = "2, 00000000:47:00.0, [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], Disabled, " + UUID(2)
    (fake_gpus / "gpus.csv").write_text(f"{lines[0]}\n{lines[1]}\n{lost}\n")
    snapshot = query_gpus()
    assert [g.index for g in snapshot] == [0, 1, 2] and snapshot[2].uuid == UUID(2)
    found = lost_gpus(plan(), [], snapshot)
    assert [(x.physical_id, x.reason.split(" (")[0]) for x in found] == [
        (2, "nvidia-smi reports it lost"),
        (3, "nvidia-smi no longer lists it"),
    ]


def kmsg_records(now_boot: float) -> str:
    """/dev/kmsg's records as the driver writes them (``priority,sequence,microseconds,flags;text``), a record's
    dictionary lines indented: an old Xid 79, an application's Xid 13, a fresh Xid 79 on GPU 2's bus, and the
    several-record form of newer drivers for GPU 3."""
    old, fresh = 1_000_000, int((now_boot - 5) * 1e6)
    return (
        f"3,100,{old},-;NVRM: Xid (PCI:0000:08:00): 79, pid=0, GPU has fallen off the bus.\n"
        f"4,101,{fresh},-;NVRM: Xid (PCI:0000:07:00): 13, pid=4242, name=python, Graphics Exception\n"
        " SUBSYSTEM=pci\n DEVICE=+pci:0000:07:00.0\n"
        f"4,102,{fresh},-;NVRM: Xid (PCI:0000:09:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
        "the bus.\n"
        f"3,103,{fresh},-;NVRM: The NVIDIA GPU 0000:0a:00.0\n"
        f"3,104,{fresh},-;NVRM: (PCI ID: 10de:20b2) installed in this system has\n"
        f"3,105,{fresh},-;NVRM: fallen off the bus and is not responding to commands.\n"
    )


def test_the_kernels_log_names_a_gpus_hardware_fault_since_the_failure(tmp_path):
    import time

    log = tmp_path / "kmsg"
    log.write_text(kmsg_records(time.clock_gettime(time.CLOCK_MONOTONIC)))
    faults = health.kernel_faults(time.time() - 60, str(log))
    assert faults == {"0:9:0": "Xid 79 (GPU has fallen off the bus)", "0:a:0": "that it has fallen off the bus"}
    found = health.lost_gpus([0, 1, 2, 3], plan().gpu_names, [], [gpu(i) for i in range(4)], kernel=faults)
    assert [(x.physical_id, x.reason) for x in found] == [
        (2, "the kernel's log reports Xid 79 (GPU has fallen off the bus)"),
        (3, "the kernel's log reports that it has fallen off the bus"),
    ]  # GPU 1's old Xid 79 (before the minutes read) and GPU 0's program error (Xid 13) blame nothing
    change = leave_out(plan(), [], lambda: [gpu(i) for i in range(4)], lambda since: faults)
    assert change is not None and change.plan is not None and change.plan.gpus == [0, 1]


def test_the_kernels_log_is_read_without_blocking_or_filling_memory(tmp_path):
    import os
    import time

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    assert health.kernel_faults(0.0, str(fifo)) == {}  # a FIFO with no writer: not a log, never waited on
    assert health.kernel_faults(0.0, "/dev/zero") == {}  # a device without end: not read
    assert health.kernel_faults(0.0, str(tmp_path / "missing")) == {}
    assert isinstance(health.kernel_faults(time.time() - 3600), dict)  # the real log: read, or not readable
    assert time.monotonic() - start < 5
