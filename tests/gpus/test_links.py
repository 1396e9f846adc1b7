"""How the GPUs are linked (gpus/links.py) and what ``--gpus auto`` makes of it (gpus/choice.py): ``nvidia-smi topo
-m`` parsed from outputs in the real format (tests/gpus/topo/: an 8-GPU NVSwitch node, a DGX-1's cube mesh, 4 PCIe
cards on 2 sockets, the issue's server with NVLink pairs), NVML's answers, the choice, elastic jobs taking GPUs back,
and the stand-in nvidia-smi (tests/fake_gpus) answering ``topo -m``.

Run: python -m pytest tests/gpus/test_links.py -q   (no GPU and no torch import needed)
"""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.gpus import links
from ignite_mgpu.gpus.acquire import acquire
from ignite_mgpu.gpus.devices import format_devices
from ignite_mgpu.gpus.holders import Holder
from ignite_mgpu.gpus.inventory import query_gpus
from ignite_mgpu.gpus.lending import Line, change_for
from ignite_mgpu.gpus.links import best_set, parse_matrix, read_matrix
from ignite_mgpu.gpus.selection import plan_gpus
from ignite_mgpu.gpus.waiting import Waiter
from tests.gpus.nvml import NVMLError, fake_pynvml
from tests.gpus.test_claims import TABLE, fake_gpus  # noqa: F401  (a fixture)
from tests.gpus.test_gpus import TOPO

TOPOS = Path(__file__).with_name("topo")
# What a driver too old to know `topo` prints (exit code 2: "a supplied argument or flag is invalid").
TOO_OLD = "ERROR: Option topo is not recognized. Please run 'nvidia-smi -h'.\n"
# A driver before 2017: SOC for SYS, the NIC named by its device, no NUMA column; as pasted (spaces, not tabs).
OLD_DRIVER = """\
        GPU0    GPU1    GPU2    GPU3    mlx4_0  CPU Affinity
GPU0     X      PIX     SOC     SOC     PHB     0-9,20-29
GPU1    PIX      X      SOC     SOC     PHB     0-9,20-29
GPU2    SOC     SOC      X      PIX     SOC     10-19,30-39
GPU3    SOC     SOC     PIX      X      SOC     10-19,30-39
mlx4_0  PHB     PHB     SOC     SOC      X

Legend:

  X   = Self
  SOC  = Connection traversing PCIe as well as the SMP link between CPU sockets(e.g. QPI)
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe switches (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing a single PCIe switch
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def topo(name):
    return (TOPOS / f"{name}.txt").read_text()


def csv(used, n=4):
    """nvidia-smi's GPU rows of ``n`` 80 GiB cards with ``used`` MiB each (a dict: id -> MiB, others 1)."""
    return "".join(
        f"{i}, 00000000:{0x07 + 8 * i:02X}:00.0, NVIDIA H100, {used.get(i, 1)}, 81920, 0\n" for i in range(n)
    )


def recorded(gpus, apps="", matrix=""):
    """A recorded nvidia-smi: the GPU rows, the compute apps, and what ``topo -m`` prints (an exception: raised)."""

    def run(argv):
        if argv[1:] == ["topo", "-m"]:
            if isinstance(matrix, Exception):
                raise matrix
            return matrix
        return gpus if argv[1].startswith("--query-gpu=") else apps

    return run


def busy(*ids):
    """The compute apps line of a process on each of ``ids``."""
    return "".join(f"00000000:{0x07 + 8 * i:02X}:00.0, {4000 + i}\n" for i in ids)


def plan(spec, snapshot):
    return plan_gpus(spec, snapshot, {})


# --- parsing nvidia-smi topo -m -----------------------------------------------------------------------------------


def test_an_nvswitch_node_of_eight_gpus_with_nics():
    m = parse_matrix(topo("dgx_h100"))
    assert sorted(m.links) == list(range(8))
    assert all(m.links[a][b] == "NV18" for a in range(8) for b in range(8) if a != b)
    assert all(len(row) == 7 for row in m.links.values())  # the NIC columns are not GPUs
    assert m.numa == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}


def test_pcie_cards_on_two_sockets():
    m = parse_matrix(topo("pcie_4gpu"))
    assert m.links[0] == {1: "PIX", 2: "PHB", 3: "SYS"} and m.links[3] == {0: "SYS", 1: "SYS", 2: "SYS"}
    assert m.numa == {0: 0, 1: 0, 2: 0, 3: 1}


def test_the_cube_mesh_of_a_dgx1_without_the_gpu_numa_id_column():
    m = parse_matrix(topo("dgx1_v100"))
    assert m.links[0] == {1: "NV1", 2: "NV1", 3: "NV2", 4: "NV2", 5: "SYS", 6: "SYS", 7: "SYS"}
    assert m.numa[7] == 1


def test_an_old_driver_pasted_with_spaces_soc_and_no_numa_column():
    m = parse_matrix(OLD_DRIVER)
    assert m.links[0] == {1: "PIX", 2: "SOC", 3: "SOC"} and m.numa == {}
    assert links.score("SOC") == links.score("SYS") and links.words("SOC") == "across CPU sockets, SOC"


def test_tabs_and_a_terminal_s_underlines_read_as_the_plain_matrix():
    underlined = TOPO.replace("\tGPU0", "\t\x1b[4mGPU0\x1b[0m")
    assert parse_matrix(underlined) == parse_matrix(TOPO) and parse_matrix(TOPO).numa == {0: 0, 1: 0, 2: 1, 3: 1}
    assert parse_matrix(TOPO.replace("\t", "    ")) == parse_matrix(TOPO)


@pytest.mark.parametrize(
    "answer",
    [
        TOO_OLD,
        "",
        "No devices were found\n",
        subprocess.CalledProcessError(2, "nvidia-smi", TOO_OLD),
        subprocess.CalledProcessError(9, "nvidia-smi", "NVIDIA-SMI has failed because it couldn't communicate"),
        FileNotFoundError("nvidia-smi"),
        subprocess.TimeoutExpired("nvidia-smi", 15),
    ],
)
def test_a_tool_that_cannot_tell_leaves_the_links_unknown(answer):
    assert read_matrix(recorded("", matrix=answer)) == links.Matrix()
    gpus = query_gpus(recorded(csv({}), matrix=answer))
    assert [g.links for g in gpus] == [()] * 4 and plan("auto:2", gpus).physical_ids == [0, 1]


def test_the_snapshot_carries_each_gpu_s_links_and_numa_node():
    gpus = query_gpus(recorded(csv({}), matrix=topo("two_sockets_nvlink_pairs")))
    assert gpus[0].links == ((1, "NV4"), (2, "SYS"), (3, "SYS")) and gpus[0].link_to(1) == "NV4"
    assert [g.numa_node for g in gpus] == [0, 0, 1, 1] and gpus[0].link_to(9) is None
    calls = []
    query_gpus(lambda argv: calls.append(argv) or csv({}, n=1) if argv[1].startswith("--query-gpu") else "")
    assert ["nvidia-smi", "topo", "-m"] not in calls  # one GPU: nothing to link


def test_nvml_links_from_nvlinks_nvswitches_and_the_pcie_ancestor(monkeypatch):
    """As NVML answers: GPU 0-1 by 4 direct NVLinks, GPU 2-3 by 2 links each to an NVSwitch (a bus that is no GPU),
    the rest by their PCIe common ancestor (GPU 0-2 one NUMA node, 40; otherwise across sockets, 50)."""

    buses = ["0000:07:00.0", "0000:0F:00.0", "0000:47:00.0", "0000:4E:00.0"]
    remote = {0: ["0000:0F:00.0"] * 4, 1: ["0000:07:00.0"] * 4, 2: ["0000:C0:00.0"] * 2, 3: ["0000:C1:00.0"] * 2}

    def link_state(h, link):
        if link >= len(remote[h]):
            raise NVMLError("Invalid Argument")
        return 1

    fake = fake_pynvml(
        4,
        "NVIDIA H100",
        lambda h: buses[h].encode(),
        80 * 1024,
        nvmlDeviceGetNvLinkState=link_state,
        nvmlDeviceGetNvLinkRemotePciInfo=lambda h, link: types.SimpleNamespace(busId=remote[h][link]),
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 40 if {a, b} == {0, 2} else 50,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus = query_gpus()
    assert dict(gpus[0].links) == {1: "NV4", 2: "NODE", 3: "SYS"}
    assert dict(gpus[2].links) == {0: "NODE", 1: "SYS", 3: "NV2"}


# --- the choice ---------------------------------------------------------------------------------------------------


def test_the_issue_two_sockets_nvlink_pairs_gpu_1_busy_auto_2_takes_the_free_pair():
    """GPU 0 has the most free memory, so without links auto:2 takes GPU 0 and 2, across the sockets."""
    gpus_csv, apps = csv({1: 40960, 2: 900, 3: 900}), busy(1)
    unknown = plan("auto:2", query_gpus(recorded(gpus_csv, apps)))
    assert unknown.physical_ids == [0, 2]
    known = plan("auto:2", query_gpus(recorded(gpus_csv, apps, topo("two_sockets_nvlink_pairs"))))
    assert known.physical_ids == [2, 3]
    assert known.messages[0] == (
        "--gpus auto:2 chose GPU 2 (no processes, 79.1 GiB free, 0% busy), GPU 3 (no processes, 79.1 GiB free, 0% "
        "busy) by their links: GPU 2,3 (NVLink NV4) rather than GPU 0,2 (across CPU sockets, SYS); skipped GPU 0 (no "
        "processes, 80.0 GiB free, 0% busy), GPU 1 (1 process, 40.0 GiB free, 0% busy)."
    )
    assert known.env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_an_elastic_range_takes_the_linked_pair_too():
    gpus = query_gpus(recorded(csv({1: 40960}), busy(1), topo("two_sockets_nvlink_pairs")))
    assert plan("auto:1-2", gpus).physical_ids == [2, 3]
    assert plan("auto:3-4", gpus).physical_ids == [0, 2, 3]  # every free GPU: the links choose nothing


def test_a_busy_gpu_is_never_taken_for_a_better_link_and_a_choice_across_sockets_is_said():
    gpus = query_gpus(recorded(csv({1: 40960, 3: 40960}), busy(1, 3), topo("two_sockets_nvlink_pairs")))
    chosen = plan("auto:2", gpus)
    assert chosen.physical_ids == [0, 2]
    assert chosen.messages[1] == (
        "GPU 0,2 (across CPU sockets, SYS) are linked only across CPU sockets or worse; GPU 0,1 (NVLink NV4) would be "
        "linked better, but not all of them are free."
    )


def test_gpus_another_job_claims_are_left_and_the_rest_chosen_by_links():
    gpus = query_gpus(recorded(csv({}), "", topo("two_sockets_nvlink_pairs")))
    assert plan("auto:2", gpus).physical_ids == [0, 1]  # all free, all pairs equal: today's order
    taken = plan_gpus("auto:2", gpus, {}, unavailable={0: "is claimed by bob (pid 7)"})
    assert taken.physical_ids == [2, 3]


def test_links_come_before_free_memory_among_idle_pcie_cards():
    """GPU 3 (socket 1) has the most free memory; GPU 0 and 1 share a PCIe switch."""
    gpus = query_gpus(recorded(csv({0: 900, 1: 900, 2: 900, 3: 1}), "", topo("pcie_4gpu")))
    chosen = plan("auto:2", gpus)
    assert chosen.physical_ids == [0, 1]
    assert (
        "by their links: GPU 0,1 (one PCIe switch, PIX) rather than GPU 0,3 (across CPU sockets, SYS)"
        in (chosen.messages[0])
    )
    assert plan("auto:3", gpus).physical_ids == [0, 1, 2]  # one socket (PHB), not GPU 3


def test_the_cube_mesh_gives_four_gpus_linked_all_by_nvlink():
    gpus = query_gpus(recorded(csv({0: 40960}, n=8), busy(0), topo("dgx1_v100")))
    assert plan("auto:4", gpus).physical_ids == [4, 5, 6, 7]
    idle = query_gpus(recorded(csv({}, n=8), "", topo("dgx1_v100")))
    assert plan("auto:4", idle).physical_ids == [0, 1, 2, 3]


def test_equal_links_keep_today_s_order_and_an_nvswitch_node_says_nothing_more():
    gpus = query_gpus(recorded(csv({0: 900, 5: 40000}, n=8), "", topo("dgx_h100")))
    chosen = plan("auto:3", gpus)
    assert chosen.physical_ids == [1, 2, 3] and "links" not in chosen.messages[0] and len(chosen.messages) == 1


def test_many_gpus_are_searched_greedily_and_still_find_the_linked_set():
    """16 GPUs, 8 wanted (12,870 sets): GPUs 8-15 are NVLinked among themselves, everything else crosses sockets."""

    def link(a, b):
        return "NV12" if a >= 8 and b >= 8 else "SYS"

    assert best_set([], list(range(16)), 8, link) == list(range(8, 16))
    assert best_set([], list(range(16)), 8, lambda a, b: None) == list(range(8))  # unknown: the order given


# --- elastic jobs taking GPUs back and lending ----------------------------------------------------------------------


# The issue's server by claim name: NVLink pairs g0-g1 and g2-g3, SYS between them.
PAIRS = {
    a: {b: "NV4" if {a, b} in ({"g0", "g1"}, {"g2", "g3"}) else "SYS" for b in "g0 g1 g2 g3".split() if b != a}
    for a in "g0 g1 g2 g3".split()
}


def test_an_elastic_job_takes_back_the_free_gpu_linked_to_its_own():
    line = Line(free=("g1", "g3"), coming=(), waiters=(), links=PAIRS)
    assert change_for(["g2"], 1, 2, line).take == ("g3",)
    assert change_for(["g2"], 1, 2, Line(free=("g1", "g3"), coming=(), waiters=())).take == ("g1",)  # unknown


def test_an_elastic_job_lends_so_that_the_gpus_it_keeps_stay_linked():
    """Holding g0, g2, g1, g3 in that CUDA order (g1 and g3 taken back later), a waiter for two gets g3 and g2:
    the job keeps the NVLinked g0, g1, not its last ones (g3, g1), which would leave it g0, g2 across sockets."""
    waiter = Waiter(Holder("bob", 1, known=True), None, 2)
    held = ["g0", "g2", "g1", "g3"]
    assert change_for(held, 2, 4, Line((), (), (waiter,), links=PAIRS)).lend == ("g3", "g2")
    assert change_for(held, 2, 4, Line((), (), (waiter,))).lend == ("g3", "g1")  # unknown: the last ones
    assert change_for(held, 3, 4, Line((), (), (Waiter(waiter.who, None, 1),), links=PAIRS)).lend == ("g3",)


# --- the stand-in nvidia-smi and the commands -------------------------------------------------------------------


def test_the_stand_in_answers_topo_as_the_real_one_and_acquire_takes_the_pair(fake_gpus, monkeypatch):  # noqa: F811
    (fake_gpus / "gpus.csv").write_text(TABLE.replace("71680", "1"))  # GPU 1 busy (40 GiB used, a process)
    (fake_gpus / "apps.csv").write_text("00000000:0F:00.0, 24410\n")
    assert [g.links for g in query_gpus()] == [tuple((o, "NV12") for o in range(4) if o != i) for i in range(4)]
    (fake_gpus / "topo.txt").write_text(topo("two_sockets_nvlink_pairs"))
    monkeypatch.setenv("IGNITE_MGPU_CLAIMS_DIR", str(fake_gpus / "claims"))
    chosen, held = acquire(DistConfig(gpus="auto:2"), {}, claim=False)
    assert chosen.physical_ids == [2, 3] and "GPU 2,3 (NVLink NV4)" in chosen.messages[0]
    (fake_gpus / "topo.txt").write_text(TOO_OLD)
    (fake_gpus / "topo.rc").write_text("2")
    assert [g.links for g in query_gpus()] == [()] * 4
    assert acquire(DistConfig(gpus="auto:2"), {}, claim=False)[0].physical_ids == [0, 2]


def test_devices_shows_each_gpu_s_links_in_a_hundred_columns(fake_gpus):  # noqa: F811
    (fake_gpus / "topo.txt").write_text(topo("two_sockets_nvlink_pairs"))
    table = CliRunner().invoke(main, ["devices"]).output
    lines = table.splitlines()
    at = lines.index("Links (nvidia-smi topo -m), best first:")
    assert lines[at + 1 :] == [
        "  GPU 0 (NUMA 0, PCIe 4.0 x16): NV4 to 1; SYS to 2,3",
        "  GPU 1 (NUMA 0, PCIe 4.0 x16): NV4 to 0; SYS to 2,3",
        "  GPU 2 (NUMA 1, PCIe 4.0 x16): NV4 to 3; SYS to 0,1",  # at gen 1 while idle: said nowhere
        "  GPU 3 (NUMA 1, PCIe 4.0 x16): NV4 to 2; SYS to 0,1",
        "  NV4: 4 NVLinks; SYS: across CPU sockets.",
        "  P2P (direct copies between GPUs): OK between every pair.",
    ]
    assert max(len(line) for line in lines[at:]) <= 100
    data = json.loads(CliRunner().invoke(main, ["devices", "--json"]).output)
    assert data["gpus"][0]["links"] == {"1": "NV4", "2": "SYS", "3": "SYS"} and data["gpus"][2]["numa_node"] == 1


def test_devices_of_an_eight_gpu_node_stays_compact_and_unknown_links_say_nothing():
    gpus = query_gpus(recorded(csv({}, n=8), "", topo("dgx_h100")))
    text = format_devices(gpus, {})
    assert "  GPU 7 (NUMA 1): NV18 to 0-6" in text.splitlines() and "  NV18: 18 NVLinks." in text
    assert "Links" not in format_devices(query_gpus(recorded(csv({}), "", TOO_OLD)), {})


def test_the_snapshot_s_numa_nodes_are_read_by_the_same_parser():
    assert [g.numa_node for g in query_gpus(recorded(csv({}), matrix=topo("pcie_4gpu")))] == [0, 0, 0, 1]
    assert [g.numa_node for g in query_gpus(recorded(csv({}), matrix=OLD_DRIVER))] == [None] * 4
