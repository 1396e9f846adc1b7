"""How the GPUs are linked: read from ``nvidia-smi topo -m`` (or NVML), ranked best first (NVLink, one PCIe switch,
several, a host bridge, one NUMA node, across CPU sockets; a pair without P2P half a step below its kind), and the
best-linked set among candidates, the one rule that ``--gpus auto`` and an elastic job taking GPUs back both follow.
Stdlib only; imports nothing of the package.
"""

from __future__ import annotations

import itertools
import math
import re
import subprocess
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)
# The link between two GPUs as topo -m prints it ("NV12", "SYS"), None if unknown; GPUs named by id or claim name.
# Where P2P is known and not OK, its status follows ("PIX CNS": ``with_p2p``).
LinkOf = Callable[[K, K], "str | None"]
# nvidia-smi's legend, best link first; SOC is what drivers before 2017 printed for SYS.
_PCIE = {"PIX": 200, "PXB": 300, "PHB": 400, "NODE": 500, "SYS": 600, "SOC": 600}
_UNKNOWN = 700
_WORDS = {
    "PIX": "one PCIe switch",
    "PXB": "several PCIe switches",
    "PHB": "a PCIe host bridge",
    "NODE": "one NUMA node, several host bridges",
    "SYS": "across CPU sockets",
    "SOC": "across CPU sockets",
}
# NVML's nvmlGpuTopologyLevel_t (INTERNAL: two GPUs of one board) as topo -m prints it.
_NVML_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# nvidia-smi topo -p2p's legend: may one GPU read the other's memory directly (OK), or why not. DR is printed by
# newer drivers only; NVML's nvmlGpuP2PStatus_t has the same seven, OK (0) to U (6) in the order of P2P_NVML.
P2P_WORDS = {
    "OK": "P2P works",
    "CNS": "not supported by the chipset",
    "GNS": "not supported by the GPU",
    "TNS": "not supported by the topology",
    "DR": "disabled by a registry key",
    "NS": "not supported",
    "U": "unknown",
}
P2P_NVML = ("OK", "CNS", "GNS", "TNS", "DR", "NS", "U")
# Without P2P, copies between the two go through host memory: half a step worse than the same kind of PCIe link with
# it, never past the next kind (and an NVLink pair without it still before any PCIe pair).
_NO_P2P = 50
# More combinations than this are searched greedily (16 GPUs, 8 wanted: 12,870 sets).
_EXHAUSTIVE = 5000


@dataclass(frozen=True)
class Matrix:
    """What ``nvidia-smi topo -m`` says of the GPUs: each pair's link as printed ("NV12", "PIX", "SYS"), by
    physical id both ways, and each GPU's NUMA node (None: N/A, a range, or a driver without the column)."""

    links: dict[int, dict[int, str]] = field(default_factory=dict)
    numa: dict[int, int | None] = field(default_factory=dict)


def with_p2p(cell: str | None, p2p: str | None) -> str | None:
    """A pair's link as the choice ranks it: the topo -m cell, followed by the P2P status where that is known and
    not OK ("PIX CNS"); None while the link is unknown."""
    return cell if cell is None or p2p in (None, "OK") else f"{cell} {p2p}"


def score(cell: str | None) -> int:
    """How good a link is, lower is better: NV# by its count of links, then PIX ... SYS, each half a step worse
    without P2P ("PIX CNS"); unknown last."""
    if cell is None:
        return _UNKNOWN
    kind, _, p2p = cell.partition(" ")
    if m := re.fullmatch(r"NV(\d+)", kind):
        found = 100 - min(int(m[1]), 99)
    else:
        found = _PCIE.get(kind, _UNKNOWN)
    return found + (_NO_P2P if p2p and found != _UNKNOWN else 0)


def meaning(cell: str) -> str:
    """What a kind of link is: "12 NVLinks", "across CPU sockets"; "unknown" for what the legend does not have. A
    P2P status after the kind is not part of it."""
    kind = cell.partition(" ")[0]
    if score(kind) == _UNKNOWN:
        return "unknown"
    if kind.startswith("NV"):
        return f"{100 - score(kind)} NVLink{'s' if score(kind) != 99 else ''}"
    return _WORDS[kind]


def words(cell: str | None) -> str:
    """A link for a message: "NVLink NV12", "across CPU sockets, SYS", "one PCIe switch, PIX, without P2P (CNS: not
    supported by the chipset)", "links unknown"."""
    if cell is None or score(cell) == _UNKNOWN:
        return "links unknown"
    kind, _, p2p = cell.partition(" ")
    found = f"NVLink {kind}" if kind.startswith("NV") else f"{_WORDS[kind]}, {kind}"
    return f"{found}, without P2P ({p2p}: {P2P_WORDS.get(p2p, 'unknown')})" if p2p else found


def split_row(line: str) -> list[str]:
    """A row's cells: tab-separated as printed (padded with extra tabs), or by two spaces in a copy."""
    return [c.strip() for c in re.split(r"\t" if "\t" in line else r"\s{2,}", line) if c.strip()]


def parse_matrix(text: str) -> Matrix:
    """``nvidia-smi topo -m``'s matrix: its header row names GPU0..GPUn, then NICs (or mlx5_0 on older drivers),
    "CPU Affinity", "NUMA Affinity" and "GPU NUMA ID" (the last two on newer drivers); each GPU row gives X for
    itself. Anything else (an error, an empty answer) is an empty Matrix."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()  # underlined headers when written to a terminal
    header = next((split_row(ln) for ln in lines if re.match(r"\s+GPU0\b", ln)), None)
    if header is None:
        return Matrix()
    gpus = {j: int(m[1]) for j, name in enumerate(header) if (m := re.fullmatch(r"GPU(\d+)", name))}
    numa_at = header.index("NUMA Affinity") if "NUMA Affinity" in header else None
    found = Matrix()
    for line in lines:
        cells = split_row(line)
        if not cells or not (m := re.fullmatch(r"GPU(\d+)", cells[0])) or len(cells) < len(gpus) + 1:
            continue
        row = int(m[1])
        found.links[row] = {other: cells[j + 1] for j, other in gpus.items() if other != row}
        if numa_at is not None and len(cells) > numa_at + 1:
            found.numa[row] = int(cells[numa_at + 1]) if cells[numa_at + 1].isdigit() else None
    return found


def read_matrix(run: Callable[[list[str]], str]) -> Matrix:
    """Ask ``nvidia-smi topo -m``; an empty Matrix when it fails (a driver that cannot answer, or one too old to
    know ``topo``: "ERROR: Option topo is not recognized", exit code 2)."""
    try:
        return parse_matrix(run(["nvidia-smi", "topo", "-m"]))
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return Matrix()


def read_nvml(
    pynvml: Any, handles: Mapping[int, Any], gpu_at: Callable[[str | bytes], int | None]
) -> dict[int, dict[int, str]]:
    """Each pair's link from NVML, as topo -m would print it: NV# from the NVLinks that are up (to the other GPU,
    or to NVSwitches both reach), else the PCIe common ancestor; {} where NVML answers neither.

    Args:
        pynvml: the module; handles: physical id -> device handle; gpu_at: a remote PCI bus id -> its GPU, or None.
    """
    ancestor = getattr(pynvml, "nvmlDeviceGetTopologyCommonAncestor", None)
    direct, switched = _nvlinks(pynvml, handles, gpu_at)
    links: dict[int, dict[int, str]] = {}
    for a, b in itertools.combinations(handles, 2):
        count = direct.get((a, b)) or direct.get((b, a)) or min(switched.get(a, 0), switched.get(b, 0))
        try:
            level = ancestor(handles[a], handles[b]) if ancestor and not count else None
        except pynvml.NVMLError:
            level = None
        cell = f"NV{count}" if count else _NVML_LEVELS.get(level) if level is not None else None
        if cell is not None:
            links.setdefault(a, {})[b] = links.setdefault(b, {})[a] = cell
    return links


def _nvlinks(
    pynvml: Any, handles: Mapping[int, Any], gpu_at: Callable[[str | bytes], int | None]
) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
    """The NVLinks up: (GPU, GPU) -> links between them, GPU -> links to anything else (NVSwitches)."""
    state, remote = (getattr(pynvml, n, None) for n in ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkRemotePciInfo"))
    direct: dict[tuple[int, int], int] = {}
    switched: dict[int, int] = {}
    if state is None or remote is None:
        return direct, switched
    for i, handle in handles.items():
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if state(handle, link) != 1:  # NVML_FEATURE_ENABLED
                    continue
                other = gpu_at(remote(handle, link).busId)
            except pynvml.NVMLError:  # no such link on this card, or no NVLink at all
                break
            if other is None:
                switched[i] = switched.get(i, 0) + 1
            else:
                direct[(i, other)] = direct.get((i, other), 0) + 1
    return direct, switched


def set_key(members: Sequence[K], link: LinkOf[K]) -> tuple[int, int]:
    """How well a set is linked, lower is better: its worst pair first (all NVLink before any PCIe), then the sum."""
    scores = [score(link(a, b)) for a, b in itertools.combinations(members, 2)]
    return (max(scores), sum(scores)) if scores else (0, 0)


def worst_pair(members: Sequence[K], link: LinkOf[K]) -> tuple[K, K] | None:
    """The pair of ``members`` with the worst link (the first such); None for fewer than two."""
    pairs = list(itertools.combinations(members, 2))
    return max(pairs, key=lambda p: score(link(*p))) if pairs else None


def best_set(base: Sequence[K], candidates: Sequence[K], count: int, link: LinkOf[K]) -> list[K]:
    """The ``count`` candidates that, with ``base`` (taken anyway), are best linked (``set_key``). Ties, and links
    unknown, keep ``candidates``' order: the first sets of it win."""
    if count >= len(candidates) or count <= 0:
        return list(candidates[: max(count, 0)])
    if math.comb(len(candidates), count) <= _EXHAUSTIVE:
        sets: Any = itertools.combinations(candidates, count)
    else:
        sets = (_grown(base, candidates, count, link, seed) for seed in candidates)
    best: list[K] = list(candidates[:count])
    best_key = set_key([*base, *best], link)
    for chosen in sets:
        key = set_key([*base, *chosen], link)
        if key < best_key:
            best, best_key = list(chosen), key
    return best


def _grown(base: Sequence[K], candidates: Sequence[K], count: int, link: LinkOf[K], seed: K) -> list[K]:
    """A set grown from ``seed``: each time the candidate best linked to what is there (the earliest of equals)."""
    chosen = [seed]
    while len(chosen) < count:
        rest = [c for c in candidates if c not in chosen]
        chosen.append(min(rest, key=lambda c: set_key([*base, *chosen, c], link)))
    return sorted(chosen, key=list(candidates).index)
