"""GPU discovery, the --gpus grammar and planning (gpus, gpu_selection), and the devices table, fed recorded
nvidia-smi output.

Run: python -m pytest tests/gpus/test_gpus.py -q   (no GPU and no torch import needed)
"""

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import inventory
from ignite_mgpu.gpus.devices import cuda_index_map, format_devices
from ignite_mgpu.gpus.inventory import GpuInfo, query_gpus
from ignite_mgpu.gpus.links import read_matrix
from ignite_mgpu.gpus.selection import GpuPlan, check_cuda_not_initialized, parse_gpus, plan_gpus
from tests.gpus.nvml import NVMLError, fake_pynvml

REAL_NVIDIA_SMI = inventory._run_nvidia_smi  # as imported, before the hermetic fixture hides nvidia-smi
# 4x A100 box: GPU 0 runs 2 jobs (70 GiB used), GPU 1 one job, GPUs 2 and 3 idle.
A100_GPUS = """\
0, 00000000:07:00.0, NVIDIA A100-SXM4-80GB, 71680, 81920, 97
1, 00000000:0F:00.0, NVIDIA A100-SXM4-80GB, 40960, 81920, 55
2, 00000000:47:00.0, NVIDIA A100-SXM4-80GB, 1, 81920, 0
3, 00000000:4E:00.0, NVIDIA A100-SXM4-80GB, 1, 81920, 0
"""
A100_APPS = """\
00000000:07:00.0, 23817
00000000:07:00.0, 23818
00000000:0F:00.0, 24410
"""
# 2x RTX 4090 workstation, idle: the compute-apps query prints nothing.
RTX_GPUS = """\
0, 00000000:01:00.0, NVIDIA GeForce RTX 4090, 2, 24564, 0
1, 00000000:41:00.0, NVIDIA GeForce RTX 4090, 2, 24564, 0
"""
# nvidia-smi topo -m of a 4x A100 machine on 2 sockets: tab-separated, padded with extra tabs.
TOPO = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV12\tNV12\tNV12\tSYS\t0-7,16-23\t0\t\tN/A\n"
    "GPU1\tNV12\t X \tNV12\tNV12\tSYS\t0-7,16-23\t0\t\tN/A\n"
    "GPU2\tNV12\tNV12\t X \tNV12\tSYS\t8-15,24-31\t1\t\tN/A\n"
    "GPU3\tNV12\tNV12\tNV12\t X \tSYS\t8-15,24-31\t1\t\tN/A\n"
    "NIC0\tSYS\tSYS\tSYS\tSYS\t X \t\t\t\n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set"
    " of # NVLinks\n\nNIC Legend:\n\n  NIC0: mlx5_0\n"
)
# An H100 in MIG mode reports no utilization.
MIG_GPUS = "0, 00000000:3B:00.0, NVIDIA H100 80GB HBM3, 11, 81559, [N/A]\n"


def recorded(gpu_text, apps_text=""):
    def run(argv):
        assert argv[0] == "nvidia-smi"
        return gpu_text if argv[1].startswith("--query-gpu=") else apps_text

    return run


@pytest.fixture
def a100():
    return query_gpus(recorded(A100_GPUS, A100_APPS))


@pytest.fixture
def rtx():
    return query_gpus(recorded(RTX_GPUS))


# --- query_gpus ---------------------------------------------------------------------------------------------


def test_query_parses_recorded_nvidia_smi(a100):
    assert a100[0] == GpuInfo(0, "00000000:07:00.0", "NVIDIA A100-SXM4-80GB", 71680, 81920, 97, 2, pids=(23817, 23818))
    assert [g.n_processes for g in a100] == [2, 1, 0, 0]
    assert [g.index for g in a100] == [0, 1, 2, 3]


def test_query_unknown_utilization_and_failed_apps_query():
    def run(argv):
        if argv[1].startswith("--query-compute-apps"):
            raise subprocess.CalledProcessError(2, argv)
        return MIG_GPUS

    (gpu,) = query_gpus(run)
    assert (gpu.utilization, gpu.n_processes, gpu.memory_total_mb) == (-1, -1, 81559)


@pytest.mark.parametrize(
    "error", [FileNotFoundError("nvidia-smi"), subprocess.CalledProcessError(9, "nvidia-smi"), PermissionError()]
)
def test_query_without_nvidia_smi_is_empty(error):
    def run(argv):
        raise error

    assert query_gpus(run) == []


def test_query_no_devices_output_is_empty():
    assert query_gpus(recorded("No devices were found\n")) == []
    assert query_gpus(recorded("")) == []


def test_query_uses_nvml_when_available(monkeypatch):
    def not_supported(handle):
        raise NVMLError("Not Supported")

    fake = fake_pynvml(
        1,
        b"NVIDIA GeForce RTX 4090",
        lambda h: b"0000:01:00.0",
        24564,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=512 * 2**20, total=24564 * 2**20),
        nvmlDeviceGetUtilizationRates=not_supported,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [object()],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert query_gpus() == [GpuInfo(0, "00000000:01:00.0", "NVIDIA GeForce RTX 4090", 512, 24564, -1, 1)]


def test_a_lost_gpu_leaves_the_others_in_the_snapshot(monkeypatch, tmp_path):
    """As the tools report a GPU that fell off the bus: NVML raises NVML_ERROR_GPU_IS_LOST for that device alone;
    nvidia-smi prints the other rows, a line for the lost one, and exits 15. Neither empties the snapshot."""

    def handle(i):
        if i == 1:
            raise NVMLError("GPU is lost")
        return f"h{i}"

    fake = fake_pynvml(
        3, "NVIDIA A100-SXM4-80GB", lambda h: f"0000:0{h[1]}:00.0", 81920, nvmlDeviceGetHandleByIndex=handle
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert [(g.index, g.pci_bus_id) for g in query_gpus()] == [(0, "00000000:00:00.0"), (2, "00000000:02:00.0")]

    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: nvidia-smi, the real program's way
    rows = "\n".join(line for line in A100_GPUS.splitlines() if not line.startswith("1,"))
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\ncase \"$*\" in *--query-gpu=*) cat <<'EOF'\n"
        f"{rows}\nUnable to determine the device handle for GPU0000:0F:00.0: GPU is lost.  Reboot the system to "
        "recover this GPU\nEOF\n;; *) ;; esac\nexit 15\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(inventory, "_run_nvidia_smi", REAL_NVIDIA_SMI)  # the real call, of the stand-in above
    assert [g.index for g in query_gpus()] == [0, 2, 3]


def test_query_falls_back_when_nvml_cannot_start(monkeypatch):
    class NVMLError(Exception):
        pass

    def fail():
        raise NVMLError("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=fail))
    monkeypatch.setattr("ignite_mgpu.gpus.inventory._run_nvidia_smi", recorded(RTX_GPUS))
    assert [g.name for g in query_gpus()] == ["NVIDIA GeForce RTX 4090"] * 2


# --- parse_gpus ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("all", ("all", None)),
        ("none", ("none", None)),
        ("auto", ("auto", None)),
        ("auto:2", ("auto", 2)),
        ("2,3", ("ids", [2, 3])),
        ("0", ("ids", [0])),
        (" 3, 1 ", ("ids", [3, 1])),
    ],
)
def test_parse_gpus_valid(spec, expected):
    assert parse_gpus(spec) == expected


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("two", "it is not one of the accepted forms"),
        ("1,,2", "it is not one of the accepted forms"),
        ("-1", "it is not one of the accepted forms"),
        ("", "it is not one of the accepted forms"),
        ("auto:", "it is not one of the accepted forms"),
        ("0.5", "it is not one of the accepted forms"),
        ("auto:0", r"auto:N needs N >= 1"),
        ("2,2", "GPU 2 is listed twice"),
    ],
)
def test_parse_gpus_garbage(spec, reason):
    with pytest.raises(
        ConfigError, match=rf"--gpus '{re.escape(spec)}' is invalid: {reason}.*auto:N.*e\.g\. --gpus 2,3"
    ):
        parse_gpus(spec)


# --- plan_gpus ----------------------------------------------------------------------------------------------


def test_plan_ids_sets_exact_env(a100):
    plan = plan_gpus("2,3", a100, {})
    assert plan.physical_ids == [2, 3]
    assert plan.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_plan_ids_keep_the_given_order(a100):
    assert plan_gpus("3,2", a100, {}).env["CUDA_VISIBLE_DEVICES"] == "3,2"


def test_plan_auto_picks_one_idle_gpu_and_says_why(a100):
    plan = plan_gpus("auto", a100, {})
    assert plan.physical_ids == [2]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2"
    assert plan.messages[0].startswith("--gpus auto chose GPU 2 (no processes, 80.0 GiB free, 0% busy); skipped")


def test_plan_auto_2_picks_the_free_ones(a100):
    plan = plan_gpus("auto:2", a100, {})
    assert plan.physical_ids == [2, 3]
    expected = (
        "--gpus auto:2 chose GPU 2 (no processes, 80.0 GiB free, 0% busy), GPU 3 (no processes, 80.0 GiB free, "
        "0% busy); skipped GPU 1 (1 process, 40.0 GiB free, 55% busy), GPU 0 (2 processes, 10.0 GiB free, 97% busy)."
    )
    assert plan.messages == [expected]


def test_plan_auto_takes_nproc_gpus_and_warns_when_busy(a100):
    plan = plan_gpus("auto", a100, {}, nproc=3)
    assert plan.physical_ids == [1, 2, 3]
    assert plan.messages[1] == "Not enough idle GPUs: GPU 1 already runs other work."


def test_plan_auto_more_than_the_machine_has(a100):
    with pytest.raises(ConfigError, match=r"--gpus auto:5 asks for 5 GPUs but this machine has 4 \(GPUs 0-3\)"):
        plan_gpus("auto:5", a100, {})


def test_plan_all_and_none(a100):
    assert plan_gpus("all", a100, {}).physical_ids == [0, 1, 2, 3]
    assert plan_gpus("all", a100, {}).env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    none = plan_gpus("none", a100, {})
    assert (none.physical_ids, none.env) == (None, {"CUDA_VISIBLE_DEVICES": ""})


def test_plan_without_spec_keeps_the_environment(a100):
    # Issue #44 (13): the ids are read as nvidia-smi's, so CUDA counts in PCI order too (not fastest first).
    assert plan_gpus(None, a100, {}) == GpuPlan([0, 1, 2, 3], {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, [])
    fastest = plan_gpus(None, a100, {"CUDA_VISIBLE_DEVICES": "2", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert fastest.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"} and fastest.physical_ids == [2]
    assert fastest.messages == [
        "Overriding CUDA_DEVICE_ORDER=FASTEST_FIRST with PCI_BUS_ID so GPU ids match nvidia-smi."
    ]
    by_uuid = plan_gpus(None, a100, {"CUDA_VISIBLE_DEVICES": "GPU-0f2c"})  # a UUID names one GPU in any order
    assert "CUDA_DEVICE_ORDER" not in by_uuid.env
    assert plan_gpus(None, a100, {"CUDA_VISIBLE_DEVICES": "3,1"}).physical_ids == [3, 1]
    assert plan_gpus(None, a100, {"CUDA_VISIBLE_DEVICES": ""}).physical_ids is None
    assert plan_gpus(None, [], {}).physical_ids is None
    assert plan_gpus(None, a100, {}, nproc=8).physical_ids == [0, 1, 2, 3]  # the launcher checks nproc per backend


def test_plan_nonexistent_id(a100):
    with pytest.raises(ConfigError, match=r"GPU 5 requested; this machine has GPUs 0-3"):
        plan_gpus("2,5", a100, {})


def test_plan_duplicate_ids(a100):
    with pytest.raises(ConfigError, match=r"--gpus '2,3,2' is invalid: GPU 2 is listed twice"):
        plan_gpus("2,3,2", a100, {})


def test_plan_garbage_spec_fails_before_looking_at_gpus():
    with pytest.raises(ConfigError, match=r"--gpus 'two' is invalid"):
        plan_gpus("two", [], {})


@pytest.mark.parametrize("spec", ["2,3", "all", "auto", "auto:2"])
def test_plan_any_gpu_spec_on_a_machine_without_gpus(spec):
    with pytest.raises(ConfigError, match=rf"--gpus {spec} requested but no NVIDIA GPU is visible.*--gpus none"):
        plan_gpus(spec, [], {})


def test_plan_none_on_a_machine_without_gpus():
    assert plan_gpus("none", [], {}).physical_ids is None


def test_plan_conflicts_with_exported_cuda_visible_devices(a100):
    with pytest.raises(ConfigError, match=r"--gpus 2,3 conflicts with CUDA_VISIBLE_DEVICES='0,1'.*unset CUDA_VISIB"):
        plan_gpus("2,3", a100, {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ConfigError, match=r"--gpus none conflicts with CUDA_VISIBLE_DEVICES='0'"):
        plan_gpus("none", a100, {"CUDA_VISIBLE_DEVICES": "0"})


def test_plan_exported_value_equal_to_ours_is_fine(a100):
    assert plan_gpus("2,3", a100, {"CUDA_VISIBLE_DEVICES": "2, 3"}).physical_ids == [2, 3]
    assert plan_gpus("auto:2", a100, {"CUDA_VISIBLE_DEVICES": "2,3"}).physical_ids == [2, 3]
    assert plan_gpus("none", a100, {"CUDA_VISIBLE_DEVICES": ""}).physical_ids is None


def test_plan_nproc_more_than_selected(a100):
    with pytest.raises(ConfigError, match=r"--nproc 4 needs 4 GPUs \(one per process\) but --gpus 2,3 selected 2 \("):
        plan_gpus("2,3", a100, {}, nproc=4)
    assert plan_gpus("2,3", a100, {}, nproc=1).physical_ids == [2, 3]  # one process over both (DataParallel)


def test_plan_overrides_fastest_first_order_with_a_message(a100):
    plan = plan_gpus("2", a100, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert plan.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "Overriding CUDA_DEVICE_ORDER=FASTEST_FIRST" in plan.messages[0]


def test_plan_rtx_40xx_disables_nccl_p2p(rtx):
    plan = plan_gpus("all", rtx, {})
    assert plan.env["NCCL_P2P_DISABLE"] == "1" and plan.env["NCCL_IB_DISABLE"] == "1"
    assert len([m for m in plan.messages if "RTX 40xx" in m]) == 1
    assert "NCCL_P2P_DISABLE" in plan_gpus(None, rtx, {}).env


def test_plan_rtx_40xx_range_that_may_grow_disables_nccl_p2p_from_its_first_gpu(rtx):
    # Started on one card of auto:1-2, the job may take the second: its workers then run NCCL over both with the
    # environment of this start (a change of size plans the rest again, not the launcher's environment).
    plan = plan_gpus("auto:1-2", rtx, {}, unavailable={1: "is claimed by bob"})
    assert plan.physical_ids == [0]
    assert plan.env["NCCL_P2P_DISABLE"] == "1" and plan.env["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in plan_gpus("auto:1-1", rtx, {}).env


def test_plan_rtx_40xx_keeps_the_users_nccl_setting(rtx):
    plan = plan_gpus("0,1", rtx, {"NCCL_P2P_DISABLE": "0"})
    assert "NCCL_P2P_DISABLE" not in plan.env
    assert plan.env["NCCL_IB_DISABLE"] == "1"


def test_plan_rtx_40xx_single_gpu_or_other_cards_untouched(rtx, a100):
    assert "NCCL_P2P_DISABLE" not in plan_gpus("0", rtx, {}).env
    assert "NCCL_P2P_DISABLE" not in plan_gpus("all", a100, {}).env


# --- cuda_index_map -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "visible, expected",
    [
        (None, {0: 0, 1: 1, 2: 2, 3: 3}),
        ("2,3", {0: None, 1: None, 2: 0, 3: 1}),
        ("3,1", {0: None, 1: 1, 2: None, 3: 0}),
        ("", {0: None, 1: None, 2: None, 3: None}),
        ("-1", {0: None, 1: None, 2: None, 3: None}),
        ("1,7,2", {0: None, 1: 0, 2: None, 3: None}),  # CUDA stops at the first invalid entry
        ("GPU-8f1c7e3a-2b4d-4c55-9e6f-0a1b2c3d4e5f", {0: None, 1: None, 2: None, 3: None}),
    ],
)
def test_cuda_index_map(a100, visible, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert cuda_index_map(a100, environ) == expected


# --- format_devices -----------------------------------------------------------------------------------------


def test_format_devices_table(a100):
    text = format_devices(a100, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"})
    header, gpu0, _, gpu2, gpu3, legend = text.splitlines()
    assert header.startswith("GPU  PCI bus id        Name ") and header.endswith("Procs  Claimed by  CUDA index")
    assert " ".join(gpu0.split()) == "0 00000000:07:00.0 NVIDIA A100-SXM4-80GB 71680 / 81920 97% 2 - -"
    assert gpu2.split()[-1] == "0" and gpu3.split()[-1] == "1"
    assert legend == "CUDA index: device number under CUDA_VISIBLE_DEVICES='2,3' ('-' = hidden)."


def test_format_devices_marks_missing_pci_bus_order(a100):
    text = format_devices(a100, {})
    assert text.splitlines()[1].endswith("0*")
    assert "*: assumes CUDA_DEVICE_ORDER=PCI_BUS_ID" in text


def test_format_devices_unknown_values():
    text = format_devices(query_gpus(recorded(MIG_GPUS, "")), {"CUDA_VISIBLE_DEVICES": "MIG-4d5e6f"})
    assert text.splitlines()[1].split()[-4:] == ["n/a", "0", "-", "?"]


def test_format_devices_all_hidden(a100):
    assert "training would use the CPU" in format_devices(a100, {"CUDA_VISIBLE_DEVICES": ""})


def test_format_devices_json_round_trip(a100):
    data = json.loads(format_devices(a100, {"CUDA_VISIBLE_DEVICES": "3"}, as_json=True))
    assert data["cpu_fallback"] is None
    assert data["gpus"][3] == {
        "index": 3,
        "pci_bus_id": "00000000:4E:00.0",
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_used_mb": 1,
        "memory_total_mb": 81920,
        "utilization": 0,
        "n_processes": 0,
        "mig": False,
        "uuid": "",
        "pids": [],
        "links": {},  # the recording has no topo -m
        "numa_node": None,
        "p2p": {},  # nor topo -p2p r
        "pcie": None,  # nor the PCIe fields
        "cuda_index": 0,
        "claim": None,
        "process_users": {},
    }
    assert [g["cuda_index"] for g in data["gpus"]] == [None, None, None, 0]


def test_format_devices_without_gpus():
    assert format_devices([], {}) == (
        "No NVIDIA GPU found (nvidia-smi not available or shows none). "
        "Training would use the CPU: backend gloo, 1 process by default (--nproc N to change)."
    )
    assert json.loads(format_devices([], {}, as_json=True)) == {
        "gpus": [],
        "cpu_fallback": {"backend": "gloo", "nproc": 1},
    }


# --- check_cuda_not_initialized -----------------------------------------------------------------------------


def fake_torch(initialized, count):
    cuda = types.SimpleNamespace(is_initialized=lambda: initialized, device_count=lambda: count)
    return types.SimpleNamespace(cuda=cuda)


def test_check_cuda_without_torch_or_before_init(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert check_cuda_not_initialized([2, 3], {}) is None  # no torch yet: nothing can have seen other GPUs
    monkeypatch.setitem(sys.modules, "torch", fake_torch(False, 4))
    assert check_cuda_not_initialized([2, 3], {}) is None  # CUDA not initialised: --gpus still takes effect


def test_check_cuda_initialized_with_the_same_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True, 2))
    assert check_cuda_not_initialized([2, 3], {"CUDA_VISIBLE_DEVICES": "2,3"}) is None  # already what it wants
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True, 4))
    assert check_cuda_not_initialized([0, 1, 2, 3], {}) is None


@pytest.mark.parametrize(
    "count, ids, environ",
    [
        (4, [2, 3], {}),  # CUDA saw all 4, the plan wants 2
        (2, [2, 3], {"CUDA_VISIBLE_DEVICES": "0,1"}),  # same count, other GPUs
        (1, None, {"CUDA_VISIBLE_DEVICES": ""}),  # hidden after init: the cached count still says 1
    ],
)
def test_check_cuda_initialized_too_early(monkeypatch, count, ids, environ):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True, count))
    with pytest.raises(ConfigError, match=r"CUDA was initialised in this process before --gpus could take effect"):
        check_cuda_not_initialized(ids, environ)


def test_module_does_not_import_torch():
    code = "import sys, ignite_mgpu.gpus.inventory; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# --- MIG ----------------------------------------------------------------------------------------------------

# An 8-GPU H100 box whose GPU 1 is split into MIG instances (the query then has a 7th column, mig.mode.current).
H100_MIG = "".join(
    f"{i}, 00000000:{0x18 + i:02X}:00.0, NVIDIA H100 80GB HBM3, 4, 81559, 0, {'Enabled' if i == 1 else 'Disabled'}\n"
    for i in range(4)
)


def test_query_reads_the_mig_mode_and_falls_back_on_drivers_without_it():
    gpus = query_gpus(recorded(H100_MIG))
    assert [g.mig for g in gpus] == [False, True, False, False] and gpus[1].utilization == 0
    calls = []

    def old_driver(argv):
        calls.append(argv[1])
        if unknown := next((f for f in ("mig.mode.current", "pcie.link.gen.gpucurrent") if f in argv[1]), None):
            raise subprocess.CalledProcessError(2, argv, f'Field "{unknown}" is not a valid field to query.')
        return A100_GPUS if argv[1] == inventory._GPU_ARGV_NO_MIG[1] else ""

    assert [g.index for g in query_gpus(old_driver)] == [0, 1, 2, 3] and calls[2:] == [
        "--query-compute-apps=gpu_bus_id,pid",
        "topo",  # how they are linked: topo -m (nothing known here, so no topo -p2p r)
        "--query-gpu=index,pcie.link.gen.gpucurrent,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max",
        "--query-gpu=index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max",
    ]


def test_mig_cards_are_refused_by_id_and_skipped_by_auto():
    gpus = query_gpus(recorded(H100_MIG))
    for spec in ("1", "0,1", "all"):
        with pytest.raises(ConfigError, match=r"GPU 1 is in MIG mode.*nvidia-smi -L.*CUDA_VISIBLE_DEVICES=MIG-<uuid>"):
            plan_gpus(spec, gpus, {})
    assert plan_gpus("auto:3", gpus, {}).physical_ids == [0, 2, 3]
    with pytest.raises(
        ConfigError, match=r"asks for 4 GPUs but this machine has 3 it can choose from \(1 in MIG mode\) \(GPUs 0-3\)"
    ):
        plan_gpus("auto:4", gpus, {})
    assert "GPU 1: MIG mode" in format_devices(gpus, {})


def test_query_reads_the_mig_mode_from_nvml(monkeypatch):
    fake = fake_pynvml(
        2,
        "NVIDIA A100-SXM4-40GB",
        lambda h: f"0000:0{h}:00.0",
        40960,
        nvmlDeviceGetMigMode=lambda h: (h, h),  # GPU 1 in MIG mode
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert [g.mig for g in query_gpus()] == [False, True]


def test_nvidia_smi_topo_gives_the_numa_affinity():
    assert read_matrix(lambda argv: TOPO).numa == {0: 0, 1: 0, 2: 1, 3: 1}
    assert read_matrix(lambda argv: "\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n").numa == {}  # old driver
