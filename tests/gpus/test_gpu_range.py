"""``--gpus auto:MIN-MAX`` (gpus/ranges.py): the strict grammar, how many GPUs a range takes from a snapshot and
around other jobs' claims, ``--wait`` for MIN, the claims it writes and what ``ignite-mgpu devices`` and
``ignite-mgpu plan`` show of it. On the 4-GPU stand-in nvidia-smi (tests/fake_gpus), with real claiming processes.

Run: python -m pytest tests/gpus/test_gpu_range.py -q
"""

import json
import os
import re

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import acquire, claims
from ignite_mgpu.gpus.devices import format_devices, who_has
from ignite_mgpu.gpus.inventory import GpuInfo, query_gpus
from ignite_mgpu.gpus.ranges import GpuRange, gpu_range
from ignite_mgpu.gpus.selection import GpusTaken, parse_gpus, plan_gpus
from ignite_mgpu.processes.machine import Machine
from ignite_mgpu.processes.plan import decide
from tests.gpus.test_claims import TABLE, UUID, claimed, fake_gpus, hold_here, jobs  # noqa: F401  (fixtures)
from tests.helpers import memory_trackers


def gpu(index: int, processes: int = 0, mig: bool = False) -> GpuInfo:
    used = 30000 * processes or 1  # a busier GPU has less free memory
    return GpuInfo(index, f"00000000:{7 + index:02X}:00.0", "NVIDIA A100-SXM4-80GB", used, 81920, 0, processes, mig)


FOUR_IDLE = [gpu(i) for i in range(4)]


@pytest.fixture
def idle_stand_in(fake_gpus):  # noqa: F811  (the fixture imported above)
    """The stand-in's 4 GPUs, none running a compute process."""
    (fake_gpus / "gpus.csv").write_text(TABLE.replace("71680", "1").replace("40960", "1"))
    (fake_gpus / "apps.csv").write_text("")
    return fake_gpus


@pytest.mark.parametrize("spec, low, high", [("auto:2-4", 2, 4), (" AUTO:1-1 ", 1, 1), ("auto:03-8", 3, 8)])
def test_a_range_parses_as_auto_with_its_bounds(spec, low, high):
    assert parse_gpus(spec) == ("auto", GpuRange(low, high))
    assert gpu_range(spec) == GpuRange(low, high) and str(GpuRange(low, high)) == f"{low}-{high}"
    assert gpu_range("auto:2") is None and gpu_range(None) is None


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("auto:0-2", r"auto:MIN-MAX needs MIN >= 1"),
        ("auto:4-2", r"auto:MIN-MAX needs MIN <= MAX, got MIN 4 > MAX 2 \(e\.g\. auto:2-4\)"),
        ("auto:2-", "it is not one of the accepted forms"),
        ("auto:-4", "it is not one of the accepted forms"),
        ("auto:2-4-6", "it is not one of the accepted forms"),
        ("auto:2..4", "it is not one of the accepted forms"),
        ("auto:2-99999", r"auto:MIN-MAX takes MAX up to 9999, got 99999 \(auto:2-9999: every free GPU from 2\)"),
        ("auto:1-" + "9" * 5000, r"auto:MIN-MAX takes MAX up to 9999, got 999999999999\.\.\. \(auto:1-9999"),
    ],
)
def test_a_bad_range_is_one_paragraph_naming_the_rule_and_the_forms(spec, reason):
    with pytest.raises(ConfigError, match=rf"--gpus '{re.escape(spec)}' is invalid: {reason}.*auto:MIN-MAX"):
        parse_gpus(spec)


def test_the_cli_refuses_a_bad_range_with_exit_2_before_anything_starts():
    result = CliRunner().invoke(main, ["train", "--gpus", "auto:4-2"])
    assert result.exit_code == 2 and "MIN <= MAX" in result.output
    # From the YAML key too: refused when the plan is made, before any process
    with pytest.raises(ConfigError, match="MIN >= 1"):
        plan_gpus("auto:0-3", FOUR_IDLE, {})


def test_a_range_takes_every_free_gpu_up_to_max_and_at_least_min():
    assert plan_gpus("auto:2-4", FOUR_IDLE, {}).physical_ids == [0, 1, 2, 3]
    assert plan_gpus("auto:1-3", FOUR_IDLE, {}).physical_ids == [0, 1, 2]
    busy = [gpu(0, 2), gpu(1, 1), gpu(2), gpu(3)]
    assert plan_gpus("auto:1-4", busy, {}).physical_ids == [2, 3]  # only the idle ones count as free
    plan = plan_gpus("auto:3-4", busy, {})  # MIN is met with a busy one, as auto:3 would
    assert plan.physical_ids == [1, 2, 3] and any("already runs other work" in m for m in plan.messages)
    assert plan_gpus("auto:2-4", FOUR_IDLE, {}, unavailable={0: "is claimed by bob"}).physical_ids == [1, 2, 3]
    assert plan_gpus("auto:1-4", [gpu(0, mig=True), *FOUR_IDLE[1:]], {}).physical_ids == [1, 2, 3]
    assert plan.names == {i: f"pci-00000000_{7 + i:02X}_00.0" for i in (1, 2, 3)}  # no UUID: by PCI bus id


def test_a_range_whose_min_is_not_left_is_refused_and_nproc_with_a_range_too():
    with pytest.raises(GpusTaken, match=r"--gpus auto:3-4 needs 3 GPUs that no other job has, but 2 of the 4"):
        plan_gpus("auto:3-4", FOUR_IDLE, {}, unavailable={0: "is claimed by bob", 1: "is claimed by bob"})
    with pytest.raises(ConfigError, match=r"--gpus auto:5-8 asks for 5 GPUs but this machine has 4"):
        plan_gpus("auto:5-8", FOUR_IDLE, {})
    with pytest.raises(ConfigError, match=r"--nproc 2 with --gpus auto:2-4: the range decides the processes"):
        plan_gpus("auto:2-4", FOUR_IDLE, {}, nproc=2)


def test_the_launch_plan_carries_the_range_and_the_gpus_names():
    gpus = plan_gpus("auto:2-4", FOUR_IDLE, {})
    plan = decide(DistConfig(gpus="auto:2-4", backend="gloo"), gpus, Machine(4), {})
    assert (plan.nproc, plan.gpus, plan.gpu_range) == (4, [0, 1, 2, 3], GpuRange(2, 4))
    assert plan.gpu_names == gpus.names and len(plan.gpu_names) == 4
    assert decide(DistConfig(gpus="auto:2", backend="gloo"), gpus, Machine(4), {}).gpu_range is None


def test_a_range_claims_every_free_gpu_of_the_stand_in_and_devices_shows_it(idle_stand_in, jobs):  # noqa: F811
    job = jobs("--gpus", "auto:2-4", "--hold")
    assert job.line()["gpus"] == [0, 1, 2, 3]
    snapshot = query_gpus()
    text = format_devices(snapshot, os.environ, claims=who_has(snapshot, os.environ))
    assert re.search(r"Elastic job of \S+ \(pid \d+\): --gpus auto:2-4, holds GPU 0-3 \(4 of 2-4\)\.", text), text
    shown = json.loads(format_devices(snapshot, os.environ, as_json=True, claims=who_has(snapshot, os.environ)))
    assert shown["elastic_jobs"] == [{"user": shown["gpus"][0]["claim"]["user"], "pid": job.proc.pid,
                                      "range": "2-4", "holds": [0, 1, 2, 3], "lent": []}]  # fmt: skip
    assert shown["gpus"][3]["claim"]["range"] == "2-4"
    job.release()
    assert claimed() == {}


def test_a_range_around_another_jobs_claims_takes_what_is_left(idle_stand_in):
    with hold_here(1):
        plan, held = acquire.acquire(DistConfig(gpus="auto:2-4"), os.environ)
        with held:
            assert plan.physical_ids == [0, 2, 3] and held.names == [UUID(0), UUID(2), UUID(3)]
            # An elastic job lets go of one GPU's claim and keeps the others (a failed GPU left out)
            assert held.release([UUID(2), "GPU-not-held"]) == [UUID(2)]
            assert held.names == [UUID(0), UUID(3)] and set(claimed()) == {UUID(0), UUID(1), UUID(3)}
        assert set(claimed()) == {UUID(1)}
    with hold_here(0, 1, 2), pytest.raises(GpusTaken, match="auto:2-4 needs 2 GPUs"):
        acquire.acquire(DistConfig(gpus="auto:2-4"), os.environ)


@pytest.mark.timeout(60)
def test_with_wait_a_range_waits_for_min_then_takes_every_free_gpu(idle_stand_in, jobs):  # noqa: F811
    holder = jobs("--gpus", "0,1,2", "--hold")
    assert holder.line()["gpus"] == [0, 1, 2]
    waiter = jobs("--gpus", "auto:2-4", "--wait", "60", "--hold", "--poll", "0.05")
    waiter.waiting()
    assert any("waiting for 2 free GPUs (up to 4) (--gpus auto:2-4;" in line for line in waiter.stderr)
    holder.release()
    assert waiter.line()["gpus"] == [0, 1, 2, 3]
    waiter.release()


@memory_trackers
def test_the_memory_plan_of_a_range_is_made_for_its_min():
    from ignite_mgpu.memory.budget import capacity  # the memory plan's: PyTorch's trackers

    cap = capacity(load_config(None, ["dist.gpus=auto:2-4"]), {}, FOUR_IDLE)
    assert cap.where == "GPU 0,1 (--gpus auto:2-4 planned at its MIN, 2 processes)" and len(cap.free) == 2


def test_a_range_is_cut_to_the_most_processes_its_batch_and_data_split_over():
    """What a start checks, every change of size must pass: auto:2-4 with a global batch of 3 runs on 2 or 3 GPUs and
    never takes a fourth (it died of data.batch_size=3 over 4 processes when it took GPUs back); said once."""
    from ignite_mgpu.jobs import range_within_the_data

    cut, said = range_within_the_data(load_config(None, ["dist.gpus=auto:2-4", "data.batch_size=3"]))
    assert cut.gpus == "auto:2-3" and gpu_range(cut.gpus) == GpuRange(2, 3)
    assert said == (
        "--gpus auto:2-4 takes at most 3 GPUs (auto:2-3), now and when more free up: data.batch_size=3 is the global "
        "batch, split over 4 processes: each needs at least one sample of it; use data.batch_size=4 or more, or run "
        "fewer processes.",
    )
    few = load_config(None, ["dist.gpus=auto:1-8", "data.val_size=5", "data.batch_size=64"])
    assert range_within_the_data(few)[0].gpus == "auto:1-5"  # every process scores a share of the validation set
    whole = load_config(None, ["dist.gpus=auto:2-4", "data.batch_size=64"])
    assert range_within_the_data(whole) == (whole.dist, ())
    with pytest.raises(ConfigError, match=r"^data.batch_size=1 is the global batch, split over 2 processes"):
        range_within_the_data(load_config(None, ["dist.gpus=auto:2-4", "data.batch_size=1"]))  # as a start on MIN


def test_every_range_the_grammar_takes_is_shown_as_elastic_and_no_other(fake_gpus):  # noqa: F811
    """auto:2-99999 was taken, and its holder file's "2-99999" was not read as a range (the readers allowed 4
    digits): the job was not shown as elastic. One grammar for both: every range the parser takes is read back."""
    from ignite_mgpu.gpus.ranges import MAX_GPUS, written_range

    assert gpu_range(f"auto:2-{MAX_GPUS}") == GpuRange(2, MAX_GPUS)
    assert [written_range(v) for v in (f"2-{MAX_GPUS}", "2-99999", "4-2", "0-1", " 2-4", 24, "２-４")] == [
        f"2-{MAX_GPUS}",
        "",
        "",
        "",
        "",
        "",
        "",
    ]
    fd = claims.open_dir(claims.claims_dir(), create=True)
    try:
        held = claims.claim(fd, [UUID(2)], f"2-{MAX_GPUS}")  # as a job on auto:2-9999 writes it
    finally:
        os.close(fd)
    assert held is not None
    with held:
        assert claimed()[UUID(2)].gpu_range == f"2-{MAX_GPUS}"
