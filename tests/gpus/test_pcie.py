"""P2P between the GPUs and each GPU's PCIe link (gpus/pcie.py), and what the choice, ``ignite-mgpu devices`` and the
CPU binding make of the snapshot: ``nvidia-smi topo -p2p r`` read from recorded outputs (tests/gpus/topo/p2p_*.txt),
the PCIe fields of ``--query-gpu`` (with a driver that knows only the older name, or neither), NVML's answers, and the
stand-in nvidia-smi (tests/fake_gpus) answering both.

Recorded outputs: p2p_8xh100_ok.txt and p2p_2xl4_cns.txt as printed in stas00/ml-engineering, network/debug/README.md
("How to check if P2P is supported": an 8x H100 node, 2x L4 without P2P, pasted with the tabs expanded);
p2p_2x5090_gns.txt (tabs as printed, the newer legend with DR) and rtx5090_2x_phb.txt (its topo -m) from
noonghunna/club-3090 issue #1229 (2x RTX 5090 on a Threadripper: P2P not supported by the GPU).

Run: python -m pytest tests/gpus/test_pcie.py -q   (no GPU and no torch import needed)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.gpus import links
from ignite_mgpu.gpus.acquire import acquire
from ignite_mgpu.gpus.devices import format_devices
from ignite_mgpu.gpus.inventory import query_gpus
from ignite_mgpu.gpus.lending import Line, change_for
from ignite_mgpu.gpus.pcie import PcieLink, parse_p2p, parse_pcie, read_p2p, read_pcie
from ignite_mgpu.gpus.selection import plan_gpus
from tests.gpus.nvml import fake_pynvml
from tests.gpus.test_claims import fake_gpus  # noqa: F401  (a fixture)

TOPOS = Path(__file__).with_name("topo")
# 4 PCIe cards on one host bridge, two under each PCIe switch, in topo -m's layout.
TWO_SWITCHES = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tPIX\tPHB\tPHB\t0-31\t0\t\tN/A\n"
    "GPU1\tPIX\t X \tPHB\tPHB\t0-31\t0\t\tN/A\n"
    "GPU2\tPHB\tPHB\t X \tPIX\t0-31\t0\t\tN/A\n"
    "GPU3\tPHB\tPHB\tPIX\t X \t0-31\t0\t\tN/A\n"
)
# Its topo -p2p r when the first switch has ACS on (P2P refused below it), in the tool's layout.
FIRST_SWITCH_CNS = (
    " \tGPU0\tGPU1\tGPU2\tGPU3\t\n GPU0\tX\tCNS\tOK\tOK\t\n GPU1\tCNS\tX\tOK\tOK\t\n"
    " GPU2\tOK\tOK\tX\tOK\t\n GPU3\tOK\tOK\tOK\tX\t\n\nLegend:\n\n  X    = Self\n  OK   = Status Ok\n"
)
REFUSED = 'Field "pcie.link.gen.gpucurrent" is not a valid field to query.\n'


def topo(name):
    return (TOPOS / f"{name}.txt").read_text()


def gpu_rows(n=4, name="NVIDIA L40S"):
    return "".join(f"{i}, 00000000:{0x07 + 8 * i:02X}:00.0, {name}, 1, 46068, 0\n" for i in range(n))


def answers(gpus, matrix="", p2p="", pcie="", refused=()):
    """A recorded nvidia-smi: each question's answer; a --query-gpu naming a field of ``refused`` exits 2."""

    def run(argv):
        if argv[1].startswith("--query-gpu=") and (bad := [f for f in refused if f in argv[1]]):
            raise subprocess.CalledProcessError(2, argv, f'Field "{bad[0]}" is not a valid field to query.\n')
        if argv[1:] == ["topo", "-m"]:
            return matrix
        if argv[1:] == ["topo", "-p2p", "r"]:
            return p2p
        if argv[1].startswith("--query-gpu=index,pcie."):
            return pcie
        return gpus if argv[1].startswith("--query-gpu=") else ""

    return run


# --- nvidia-smi topo -p2p r ---------------------------------------------------------------------------------------


def test_p2p_read_from_an_h100_node_l4s_and_rtx_5090s_as_printed():
    h100 = parse_p2p(topo("p2p_8xh100_ok"))
    assert sorted(h100) == list(range(8)) and all(s == "OK" for row in h100.values() for s in row.values())
    assert all(len(row) == 7 for row in h100.values())
    assert parse_p2p(topo("p2p_2xl4_cns")) == {0: {1: "CNS"}, 1: {0: "CNS"}}  # pasted without its legend
    assert parse_p2p(topo("p2p_2x5090_gns")) == {0: {1: "GNS"}, 1: {0: "GNS"}}  # tabs, and DR in the legend
    underlined = topo("p2p_2x5090_gns").replace("\tGPU0\tGPU1", "\t\x1b[4mGPU0\tGPU1\x1b[0m")
    assert parse_p2p(underlined) == parse_p2p(topo("p2p_2x5090_gns"))
    assert parse_p2p(" \tGPU0\tGPU1\t\n GPU0\tX\t??\t\n GPU1\tOK\tX\t\n") == {0: {}, 1: {0: "OK"}}  # not a status


@pytest.mark.parametrize(
    "answer",
    [
        "",
        "ERROR: Option -p2p is not recognized. Please run 'nvidia-smi -h'.\n",
        subprocess.CalledProcessError(2, "nvidia-smi"),
        FileNotFoundError("nvidia-smi"),
        subprocess.TimeoutExpired("nvidia-smi", 15),
    ],
)
def test_a_driver_that_cannot_answer_p2p_leaves_it_unknown_and_the_snapshot_whole(answer):
    def run(argv):
        if argv[1:3] == ["topo", "-p2p"]:
            if isinstance(answer, Exception):
                raise answer
            return answer
        return answers(gpu_rows(2), topo("rtx5090_2x_phb"))(argv)

    assert read_p2p(run) == {}
    gpus = query_gpus(run)
    assert [g.p2p for g in gpus] == [(), ()] and gpus[0].link_to(1) == "PHB" and gpus[0].path_to(1) == "PHB"


def test_the_snapshot_carries_p2p_and_a_pair_without_it_is_said_by_its_path():
    gpus = query_gpus(answers(gpu_rows(2, "NVIDIA GeForce RTX 5090"), topo("rtx5090_2x_phb"), topo("p2p_2x5090_gns")))
    assert gpus[0].p2p == ((1, "GNS"),) and gpus[0].path_to(1) == "PHB GNS"
    assert links.words(gpus[0].path_to(1)) == "a PCIe host bridge, PHB, without P2P (GNS: not supported by the GPU)"


# --- ranking ------------------------------------------------------------------------------------------------------


def test_a_pair_without_p2p_ranks_half_a_step_below_its_kind():
    assert links.score("PIX") < links.score("PIX CNS") < links.score("PXB") < links.score("PXB U")
    assert links.score("NV12 NS") < links.score("PIX") and links.score("SYS TNS") < links.score(None)
    assert links.with_p2p("PIX", "OK") == "PIX" and links.with_p2p("PIX", None) == "PIX"
    assert links.with_p2p(None, "CNS") is None  # the link unknown: unknown
    assert links.meaning("PIX CNS") == links.meaning("PIX") == "one PCIe switch"
    assert links.set_key([0, 1], lambda a, b: "PIX CNS") > links.set_key([0, 1], lambda a, b: "PIX")


def test_auto_takes_the_switch_whose_p2p_works_and_says_why():
    run = answers(gpu_rows(), TWO_SWITCHES, FIRST_SWITCH_CNS)
    chosen = plan_gpus("auto:2", query_gpus(run), {})
    assert chosen.physical_ids == [2, 3]
    assert (
        "by their links: GPU 2,3 (one PCIe switch, PIX) rather than GPU 0,1 (one PCIe switch, PIX, without P2P (CNS: "
        "not supported by the chipset))" in chosen.messages[0]
    )
    everywhere = FIRST_SWITCH_CNS.replace("OK", "CNS").replace("= Status CNS", "= Status Ok")
    assert plan_gpus("auto:2", query_gpus(answers(gpu_rows(), TWO_SWITCHES, everywhere)), {}).physical_ids == [0, 1]


def test_an_elastic_job_takes_back_the_gpu_it_has_p2p_with():
    pairs = {"g0": {"g1": "PIX CNS", "g2": "PIX"}, "g1": {"g0": "PIX CNS"}, "g2": {"g0": "PIX"}}
    assert change_for(["g0"], 1, 2, Line(free=("g1", "g2"), coming=(), waiters=(), links=pairs)).take == ("g2",)


# --- the PCIe link ------------------------------------------------------------------------------------------------


def test_pcie_fields_read_with_unknowns_and_said_with_the_width_that_matters():
    found = parse_pcie("0, 4, 4, 16, 16\n1, 1, 4, 16, 16\n2, 4, 4, 4, 16\n3, [N/A], [N/A], [N/A], [N/A]\nNo devices\n")
    assert found[0] == PcieLink(4, 4, 16, 16) and found[3] == PcieLink(-1, -1, -1, -1) and sorted(found) == [0, 1, 2, 3]
    assert [found[i].describe() for i in range(4)] == ["PCIe 4.0 x16", "PCIe 4.0 x16", "PCIe 4.0 x4 of x16", "PCIe"]
    assert [found[i].narrowed for i in range(4)] == [False, False, True, False]  # gen 1 while idle: not a fault
    assert PcieLink(3, -1, -1, 8).describe() == "PCIe 3.0 x8"


def test_an_older_driver_answers_by_the_older_field_name_and_one_knowing_neither_leaves_it_unknown():
    pcie = "0, 1, 3, 16, 16\n1, 3, 3, 8, 16\n"
    assert read_pcie(answers("", pcie=pcie, refused=["pcie.link.gen.gpucurrent"]))[1] == PcieLink(3, 3, 8, 16)
    none_known = answers(gpu_rows(2), topo("rtx5090_2x_phb"), pcie=pcie, refused=["pcie.link.gen"])
    assert read_pcie(none_known) == {}
    gpus = query_gpus(none_known)
    assert [g.pcie for g in gpus] == [None, None] and gpus[1].link_to(0) == "PHB"  # the rest of the snapshot stands


def test_one_gpu_asks_nothing_more_than_before():
    calls = []
    query_gpus(lambda argv: calls.append(argv) or (gpu_rows(1) if argv[1].startswith("--query-gpu") else ""))
    assert [argv[1] for argv in calls] == [
        "--query-gpu=index,pci.bus_id,name,memory.used,memory.total,utilization.gpu,mig.mode.current,uuid",
        "--query-compute-apps=gpu_bus_id,pid",
    ]


# --- NVML ---------------------------------------------------------------------------------------------------------


def test_nvml_gives_p2p_the_pcie_link_and_the_numa_node(monkeypatch):
    """As NVML answers: P2P read status 0 (OK) but 1 (chipset not supported) between GPU 0 and 2; GPU 1 on 4 of its
    16 lanes; memory affinity one NUMA node each (a bit mask of 64-bit words)."""

    def p2p(a, b, index):
        assert index == 0 and isinstance(index, int)  # NVML_P2P_CAPS_INDEX_READ, not pynvml's tuple
        return 1 if {a, b} == {0, 2} else 0

    fake = fake_pynvml(
        3,
        "NVIDIA L40S",
        lambda h: f"0000:{0x07 + 8 * h:02X}:00.0",
        45 * 1024,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 30,
        nvmlDeviceGetP2PStatus=p2p,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 1,
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 4,
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 4 if h == 1 else 16,
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetMemoryAffinity=lambda h, size, scope: [1 << (h // 2)] + [0] * (size - 1),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus = query_gpus()
    assert dict(gpus[0].p2p) == {1: "OK", 2: "CNS"} and gpus[0].path_to(2) == "PHB CNS"
    assert [g.pcie.describe() for g in gpus] == ["PCIe 4.0 x16", "PCIe 4.0 x4 of x16", "PCIe 4.0 x16"]
    assert [g.numa_node for g in gpus] == [0, 0, 1]


# --- the stand-in nvidia-smi, devices and --gpus auto --------------------------------------------------------------


def test_devices_says_the_pairs_without_p2p_and_a_narrowed_link(fake_gpus):  # noqa: F811
    (fake_gpus / "gpus.csv").write_text(
        "".join(
            f"{i}, 00000000:{bus}:00.0, RTX 5090, 2, 32607, 0, Disabled, GPU-5090000{i}-0000-4000-8000-0\n"
            for i, bus in enumerate(["01", "41"])
        )
    )
    (fake_gpus / "apps.csv").write_text("")
    (fake_gpus / "topo.txt").write_text(topo("rtx5090_2x_phb"))
    (fake_gpus / "p2p.txt").write_text(topo("p2p_2x5090_gns"))
    (fake_gpus / "pcie.csv").write_text("0, 1, 5, 16, 16\n1, 1, 5, 8, 16\n")  # both idle (gen 1); GPU 1 on 8 lanes
    lines = CliRunner().invoke(main, ["devices"]).output.splitlines()
    at = lines.index("Links (nvidia-smi topo -m), best first:")
    assert lines[at + 1 :] == [
        "  GPU 0 (NUMA 0, PCIe 5.0 x16): PHB to 1; no P2P to 1 (GNS)",
        "  GPU 1 (NUMA 0, PCIe 5.0 x8 of x16, narrowed): PHB to 0; no P2P to 0 (GNS)",
        "  PHB: a PCIe host bridge.",
        "  No P2P: copies between those GPUs go through host memory; GNS: not supported by the GPU.",
        "  Narrowed: fewer PCIe lanes than the card has (a smaller slot or a riser): copies are slower.",
    ]
    assert max(len(line) for line in lines[at:]) <= 100
    data = json.loads(CliRunner().invoke(main, ["devices", "--json"]).output)
    assert data["gpus"][1]["p2p"] == {"0": "GNS"}
    assert data["gpus"][1]["pcie"] == {"gen": 1, "max_gen": 5, "width": 8, "max_width": 16, "narrowed": True}


def test_auto_says_when_it_takes_a_gpu_on_a_narrowed_link_and_not_for_an_idle_generation(fake_gpus, monkeypatch):  # noqa: F811
    monkeypatch.setenv("IGNITE_MGPU_CLAIMS_DIR", str(fake_gpus / "claims"))
    chosen = acquire(DistConfig(gpus="auto:2"), {}, claim=False)[0]
    assert chosen.physical_ids == [2, 3] and len(chosen.messages) == 1  # at gen 1 while idle: nothing to say
    (fake_gpus / "pcie.csv").write_text("0, 4, 4, 16, 16\n1, 4, 4, 16, 16\n2, 1, 4, 16, 16\n3, 1, 4, 4, 16\n")
    chosen = acquire(DistConfig(gpus="auto:2"), {}, claim=False)[0]
    assert chosen.physical_ids == [2, 3] and chosen.messages[1] == (
        "GPU 3 runs on a narrowed PCIe link, PCIe 4.0 x4 of x16 (a smaller slot or a riser): its copies to the host "
        "and to GPUs without NVLink are slower."
    )


def test_the_stand_in_refuses_fields_an_old_driver_does_not_know(fake_gpus):  # noqa: F811
    (fake_gpus / "unknown_fields").write_text("pcie.link.gen.gpucurrent\n")
    assert [g.pcie for g in query_gpus()] == [PcieLink(4, 4, 16, 16)] * 2 + [PcieLink(1, 4, 16, 16)] * 2
    (fake_gpus / "unknown_fields").write_text("mig.mode.current\npcie.link.gen.gpucurrent\npcie.link.gen.current\n")
    gpus = query_gpus()
    assert [g.pcie for g in gpus] == [None] * 4 and [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[0].uuid.startswith("GPU-") and gpus[0].link_to(1) == "NV12" and dict(gpus[0].p2p)[1] == "OK"
    assert "Narrowed" not in format_devices(gpus, {})
