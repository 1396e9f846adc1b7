"""The CPU binding plan (--cpu-binding), a pure function of the mode and a snapshot of the machine: fake /sys trees
and recorded GPU snapshots stand in for real machines; applying a binding in this process is undone after.

Run: python -m pytest tests/cpus/test_binding.py -q   (spawns nothing)
"""

import dataclasses
import os
import threading

import pytest
import torch

from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.cpus import affinity, topology
from ignite_mgpu.cpus.affinity import apply_binding
from ignite_mgpu.cpus.binding import RankBinding, plan_binding, plan_for_job
from ignite_mgpu.cpus.topology import Topology, parse_cpulist, read_topology
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import inventory
from ignite_mgpu.gpus.links import read_matrix
from ignite_mgpu.processes.plan import make_plan
from ignite_mgpu.text import format_ids
from tests.gpus.test_gpus import TOPO


def flat(cpus, nodes=None, smt_offset=None):
    """A topology of ``cpus`` online, optionally SMT siblings ``k`` and ``k + smt_offset``."""
    cpus = sorted(cpus)
    core_of = {c: (c % smt_offset if smt_offset else c) for c in cpus}
    return Topology(frozenset(cpus), nodes if nodes is not None else {0: frozenset(cpus)}, core_of, {})


def cpus_of(plan):
    return [format_ids(r.cpus) for r in plan.ranks]


def test_cpulists_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()
    assert format_ids({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10,11"
    assert format_ids([5]) == "5"


@pytest.mark.parametrize(
    "allowed, nproc, expected, threads",
    [
        (range(8), 2, ["0-3", "4-7"], [4, 4]),
        (range(8), 3, ["0-2", "3-5", "6,7"], [3, 3, 2]),  # the first ranks take the remainder
        ({0, 2, 4, 6, 9}, 2, ["0,2,4", "6,9"], [3, 2]),  # non-contiguous: contiguous in the allowed order
        ({1}, 1, ["1"], [1]),
    ],
)
def test_cores_gives_each_rank_a_contiguous_share_of_the_allowed_cpus(allowed, nproc, expected, threads):
    plan = plan_binding("cores", nproc, allowed, {}, flat(allowed), None)
    assert plan.mode == "cores" and cpus_of(plan) == expected
    assert [r.threads for r in plan.ranks] == threads
    assert [r.share for r in plan.ranks] == [len(parse_cpulist(c)) for c in expected]


def test_cores_keeps_smt_siblings_together_and_counts_physical_cores():
    smt = flat(range(16), smt_offset=8)  # 8 cores; CPU k and k+8 share one
    plan = plan_binding("cores", 2, range(16), {}, smt, None)
    assert cpus_of(plan) == ["0-3,8-11", "4-7,12-15"]
    assert [(r.threads, r.share) for r in plan.ranks] == [(4, 8), (4, 8)]  # a thread per core; the siblings count
    many = plan_binding("cores", 12, range(16), {}, smt, None)  # more ranks than cores: single CPUs
    assert cpus_of(many)[:2] == ["0,1", "2,3"] and len(many.ranks) == 12


def test_cores_keeps_a_thread_count_the_user_set():
    plan = plan_binding("cores", 2, range(4), {"OMP_NUM_THREADS": "3"}, flat(range(4)), None)
    assert cpus_of(plan) == ["0,1", "2,3"] and all(r.threads is None for r in plan.ranks)
    assert plan.reason == "cpu binding: cores (as asked; OMP_NUM_THREADS=3 kept)"
    assert plan.ranks[0].describe() == "CPUs 0,1 (cores), threads as set, process-group threads on 0-3"


def test_cores_with_more_processes_than_cpus_is_refused():
    with pytest.raises(ConfigError) as err:
        plan_binding("cores", 3, {4, 5}, {}, flat({4, 5}), None)
    assert str(err.value) == (
        "--cpu-binding cores (dist.cpu_binding) cannot apply here: 3 processes need a CPU each, but this job may use "
        "2 CPUs (4,5: the affinity it was started with). Fix: lower --nproc, allow the job more CPUs (taskset, the "
        "cgroup or SLURM allocation), or use --cpu-binding none to let the processes share the CPUs."
    )


def test_none_is_todays_behaviour():
    plan = plan_binding("none", 2, range(8), {}, None, None)
    assert plan.mode == "none" and plan.reason == ""
    assert all(r.cpus is None and r.threads is None and r.share == 4 for r in plan.ranks)
    assert plan.rank(0).describe() == ""


@pytest.mark.parametrize(
    "environ, allowed, nproc, gpus_, mode, why",
    [
        ({}, range(4), 2, None, "cores", "cpu binding: cores (auto: 2 CPU processes on 4 CPUs (0-3): a share each)"),
        ({}, range(4), 1, None, "cores", "cpu binding: cores (auto: 1 CPU process on 4 CPUs (0-3): a share each)"),
        ({"OMP_NUM_THREADS": "2"}, range(4), 2, None, "none", "cpu binding: none (auto: OMP_NUM_THREADS=2 is set)"),
        (
            {},
            {0, 1},
            2,
            None,
            "none",
            "cpu binding: none (auto: the job's affinity is already restricted to CPUs 0,1)",
        ),
        (
            {},
            range(4),
            5,
            None,
            "none",
            "cpu binding: none (auto: 5 processes need a CPU each, but this job may use 4 CPUs (0-3: the affinity "
            "it was started with))",
        ),
        ({}, range(4), 2, [[0], [1]], "none", "cpu binding: none (auto: GPU training on a machine with one NUMA node)"),
    ],
)
def test_auto_binds_only_where_nothing_was_decided_already(environ, allowed, nproc, gpus_, mode, why):
    plan = plan_binding("auto", nproc, allowed, environ, flat(range(4)), gpus_)
    assert (plan.mode, plan.reason) == (mode, why)
    assert len(plan.ranks) == nproc
    if mode == "none":
        assert all(r.cpus is None and r.threads is None for r in plan.ranks)  # nothing changes: today's behaviour


def test_under_torchrun_or_slurm_the_outer_launcher_binds():
    plan = plan_binding("auto", 2, range(4), {}, None, None, external=True)
    assert plan.mode == "none" and plan.reason == "cpu binding: none (auto: torchrun/SLURM placed the processes)"
    for mode in ("cores", "numa"):
        with pytest.raises(ConfigError, match=rf"--cpu-binding {mode}: this process was started by torchrun/SLURM"):
            plan_binding(mode, 2, range(4), {}, None, None, external=True)


def test_make_plan_carries_the_binding(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    allowed = sorted(os.sched_getaffinity(0))
    plan = make_plan(DistConfig(nproc=1, cpu_binding="cores"))[0]
    assert plan.binding.mode == "cores" and plan.binding.ranks[0].cpus == tuple(allowed)
    assert make_plan(DistConfig(nproc=1))[0].binding.mode == "none"  # the default
    with pytest.raises(ConfigError, match="cannot apply here: .* need a CPU each"):
        make_plan(DistConfig(nproc=len(allowed) + 1, cpu_binding="cores", backend="gloo"))[0]
    with pytest.raises(ConfigError, match="numa binds each rank to the CPUs of its GPU's NUMA node, but this job "):
        make_plan(DistConfig(nproc=1, cpu_binding="numa"))[0]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert make_plan(DistConfig(cpu_binding="auto"))[0].binding.mode == "none"
    with pytest.raises(ConfigError, match="torchrun --numa-binding node, srun --cpu-bind=cores"):
        make_plan(DistConfig(cpu_binding="cores"))[0]


# ------------------------------------------------------------------------------------ numa: a fake 2-socket machine

# 4x A100 (the bus ids of tests/gpus/test_gpus.py) on 2 sockets, 8 cores each with 2 hyper-threads: node 0 has CPUs
# 0-7 and their siblings 16-23, node 1 has 8-15 and 24-31. GPUs 0, 1 sit on node 0, GPUs 2, 3 on node 1.
FOUR_A100 = [
    inventory.GpuInfo(i, f"00000000:{bus}:00.0", "NVIDIA A100-SXM4-80GB", 1, 81920, 0, 0)
    for i, bus in enumerate(["07", "0F", "47", "4E"])
]
NODES = {0: "0-7,16-23", 1: "8-15,24-31"}
GPU_NODES = {"0000:07:00.0": "0", "0000:0f:00.0": "0", "0000:47:00.0": "1", "0000:4e:00.0": "1"}


def fake_sys(root, nodes=NODES, gpu_nodes=GPU_NODES, online="0-31", smt=16):
    """A /sys tree with what read_topology reads: online CPUs, NUMA nodes, SMT siblings, the GPUs' numa_node."""
    cpu = root / "devices/system/cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(online + "\n")
    for c in parse_cpulist(online):
        (cpu / f"cpu{c}/topology").mkdir(parents=True)
        (cpu / f"cpu{c}/topology/thread_siblings_list").write_text(f"{c % smt},{c % smt + smt}\n")
    for node, cpus in nodes.items():
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    for bus, node in gpu_nodes.items():
        (root / f"bus/pci/devices/{bus}").mkdir(parents=True)
        (root / f"bus/pci/devices/{bus}/numa_node").write_text(node + "\n")
    return root


def test_topology_is_read_from_sys(tmp_path):
    topo = read_topology(range(32), {g.index: g.pci_bus_id for g in FOUR_A100}, str(fake_sys(tmp_path)))
    assert topo.online == frozenset(range(32)) and sorted(topo.nodes) == [0, 1]
    assert topo.nodes[1] == frozenset(parse_cpulist("8-15,24-31"))
    assert topo.core_of[20] == 4 and topo.core_of[4] == 4
    assert topo.gpu_nodes == {0: 0, 1: 0, 2: 1, 3: 1}


def test_topology_without_numa_information(tmp_path):
    root = tmp_path / "sys"
    root.mkdir()
    topo = read_topology({0, 1}, {0: "00000000:07:00.0"}, str(root))
    assert topo.nodes == {} and topo.gpu_nodes == {0: None} and topo.core_of == {0: 0, 1: 1}
    one_node = fake_sys(tmp_path / "one", nodes={0: "0-31"}, gpu_nodes={"0000:07:00.0": "-1"})
    assert read_topology({0}, {0: "00000000:07:00.0"}, str(one_node)).gpu_nodes == {0: 0}  # -1: the only node


@pytest.fixture
def two_sockets(tmp_path, monkeypatch):
    monkeypatch.setattr(topology, "SYS", str(fake_sys(tmp_path)))
    monkeypatch.setattr(inventory, "query_gpus", lambda run=None: FOUR_A100)
    return set(range(32))


def job(mode, gpu_ids, allowed, nproc=2, environ=None, strategy="ddp"):
    return plan_for_job(mode, nproc, gpu_ids, True, strategy, environ or {}, allowed=allowed)


def test_numa_binds_each_rank_to_its_gpus_node(two_sockets):
    plan = job("numa", [1, 2], two_sockets)  # --gpus 1,2: one rank on each socket
    assert plan.mode == "numa" and cpus_of(plan) == ["0-7,16-23", "8-15,24-31"]
    assert [(r.threads, r.share) for r in plan.ranks] == [(8, 16), (8, 16)]
    assert plan.ranks[1].describe() == "CPUs 8-15,24-31 (NUMA node 1 of GPU 2), 8 intra-op threads"
    shared = job("numa", [2, 3], two_sockets)  # both on node 1: they share its CPUs, and split threads and share
    assert cpus_of(shared) == ["8-15,24-31"] * 2 and [(r.threads, r.share) for r in shared.ranks] == [(4, 8)] * 2
    dp = job("numa", [0, 2], two_sockets, nproc=1, strategy="dp")  # one process drives GPUs on both nodes
    assert cpus_of(dp) == ["0-31"] and dp.ranks[0].where == "NUMA node 0,1 of GPU 0,2"


def test_numa_respects_the_allowed_cpus(two_sockets):
    plan = job("numa", [0, 2], set(range(4, 12)))
    assert cpus_of(plan) == ["4-7", "8-11"] and [r.threads for r in plan.ranks] == [4, 4]
    with pytest.raises(ConfigError, match=r"GPU 2 sits on NUMA node 1, whose CPUs are all outside this job's CPUs 0-7"):
        job("numa", [0, 2], set(range(8)))


def test_auto_on_a_gpu_machine_with_several_nodes_is_numa(two_sockets):
    plan = job("auto", None, two_sockets)  # without --gpus: the GPUs CUDA sees, cuda:k -> GPU k
    assert plan.mode == "numa" and cpus_of(plan) == ["0-7,16-23"] * 2
    assert plan.reason == "cpu binding: numa (auto: GPUs on a machine with 2 NUMA nodes; each rank on its GPU's node)"
    assert job("auto", [0, 2], set(range(16))).reason == (
        "cpu binding: none (auto: the job's affinity is already restricted to CPUs 0-15)"
    )


def test_unknown_gpu_node_falls_back_to_the_snapshot_s_node_without_asking_again(tmp_path, monkeypatch):
    """Where /sys does not say, the node nvidia-smi topo -m gave the snapshot (or NVML) is used: no second call."""
    unknown = {bus: "-1" for bus in GPU_NODES}  # the firmware does not say
    monkeypatch.setattr(topology, "SYS", str(fake_sys(tmp_path, gpu_nodes=unknown)))
    numa = read_matrix(lambda argv: TOPO).numa
    snapshots = []

    def snapshot(run=None, nodes=True):
        snapshots.append(run)
        return [dataclasses.replace(g, numa_node=numa[g.index] if nodes else None) for g in FOUR_A100]

    monkeypatch.setattr(inventory, "query_gpus", snapshot)
    monkeypatch.setattr(inventory, "_run_nvidia_smi", lambda argv: pytest.fail(f"asked again: {argv}"))
    assert cpus_of(job("numa", [3], set(range(32)), nproc=1)) == ["8-15,24-31"] and len(snapshots) == 1
    monkeypatch.setattr(inventory, "query_gpus", lambda run=None: snapshot(run, nodes=False))  # nor can they tell
    with pytest.raises(ConfigError) as err:
        job("numa", [3], set(range(32)), nproc=1)
    assert str(err.value) == (
        "--cpu-binding numa (dist.cpu_binding) cannot apply here: the NUMA node of GPU 3 is unknown (neither /sys "
        "nor nvidia-smi topo -m nor NVML says). Fix: use --cpu-binding cores (each process its own share of the CPUs) "
        "or --cpu-binding none."
    )
    auto = job("auto", [3], set(range(32)), nproc=1)
    assert auto.mode == "none" and "auto: the NUMA node of GPU 3 is unknown" in auto.reason


def test_numa_without_numa_information_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(topology, "SYS", str(tmp_path))  # an empty /sys
    monkeypatch.setattr(inventory, "query_gpus", lambda run=None: FOUR_A100)
    with pytest.raises(ConfigError, match=r"this machine exposes no NUMA information \(no node\*/cpulist"):
        job("numa", [0, 1], {0, 1, 2, 3})


# ------------------------------------------------------------------------------------ applying it in a process


def test_apply_binds_every_thread_sets_the_threads_and_undo_restores():
    before, threads_before = os.sched_getaffinity(0), torch.get_num_threads()
    cpu = min(before)
    ready, release = threading.Event(), threading.Event()
    seen = {}

    def waiter():  # a thread started before the binding (as an import might start one)
        ready.set()
        release.wait(10)
        seen["mask"] = os.sched_getaffinity(0)

    t = threading.Thread(target=waiter)
    t.start()
    ready.wait(10)
    undo = apply_binding(RankBinding((cpu,), 1, 1, "cores"))
    try:
        assert os.sched_getaffinity(0) == {cpu} and torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "1"
        assert affinity.current().share == 1 and affinity.cpu_share(4) == 1
        release.set()
        t.join(10)
        assert seen["mask"] == {cpu}  # the earlier thread moved too
    finally:
        undo()
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads_before
    assert affinity.current() is None and affinity.cpu_share(1) == len(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: a share and another")
def test_the_process_groups_threads_get_the_jobs_cpus_and_no_other_thread_does():
    before, cpu, other = os.sched_getaffinity(0), min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    release, masks, threads = threading.Event(), {}, []

    def start(name, own=None):  # a thread still running when free_group_threads looks
        ready = threading.Event()

        def body():
            if own is not None:
                os.sched_setaffinity(0, own)  # a thread that chose its CPUs itself
            ready.set()
            release.wait(10)
            masks[name] = os.sched_getaffinity(0)

        threads.append(threading.Thread(target=body))
        threads[-1].start()
        ready.wait(10)

    undo = apply_binding(RankBinding((cpu,), None, 1, "cores", tuple(sorted(before))))
    try:
        start("before the group")  # e.g. a thread an import started: it stays on the share
        started = affinity.thread_ids()
        start("the group's")  # inherits the share from the training thread
        start("its own mask", own={other})
        affinity.free_group_threads(started)
        assert os.sched_getaffinity(0) == {cpu}  # the training thread keeps its share
    finally:
        release.set()
        for t in threads:
            t.join(10)
        undo()
    assert masks == {"before the group": {cpu}, "the group's": before, "its own mask": {other}}
    assert os.sched_getaffinity(0) == before


def test_numa_keeps_the_process_groups_threads_next_to_the_gpu(two_sockets):
    plan = job("numa", [0, 2], two_sockets)
    assert all(r.group_cpus is None for r in plan.ranks) and "process-group" not in plan.ranks[0].describe()


def test_numa_needs_to_know_each_ranks_gpu(two_sockets, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f6c1a2e,GPU-77aa01b3")
    with pytest.raises(ConfigError, match="the physical GPU of local rank 0 is unknown .*select the GPUs with --gpus"):
        plan_for_job("numa", 2, None, True, "ddp", os.environ, allowed=two_sockets)
    with pytest.raises(ConfigError, match="the physical GPU of local rank 1 is unknown"):
        job("numa", [2], two_sockets)  # 2 processes, one GPU
