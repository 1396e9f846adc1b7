"""What each GPU's PCIe allows: whether two GPUs may read each other's memory directly (P2P: ``nvidia-smi topo -p2p r``
or NVML), and each GPU's PCIe link, its generation and width now against the card's maximum (``--query-gpu`` or
NVML). A narrowed width (a x16 card in a x4 slot or riser) is the fault worth saying; a lower generation is not:
the driver lowers it while the GPU idles, to save power. Stdlib only.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ignite_mgpu.gpus import links

P2P_ARGV = ["nvidia-smi", "topo", "-p2p", "r"]
# NVML_P2P_CAPS_INDEX_READ, written out: nvidia-ml-py (13.615) defines it as the tuple (0,), which ctypes refuses.
_P2P_READ = 0
_PCIE_FIELDS = "pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
# The current generation's field was renamed (pcie.link.gen.gpucurrent); drivers before the rename know only
# pcie.link.gen.current and refuse the query ('Field "..." is not a valid field to query.', exit code 2).
PCIE_ARGVS = [
    ["nvidia-smi", f"--query-gpu=index,pcie.link.gen.{current},{_PCIE_FIELDS}", "--format=csv,noheader,nounits"]
    for current in ("gpucurrent", "current")
]
_FAILED = (OSError, subprocess.SubprocessError, UnicodeDecodeError)


@dataclass(frozen=True)
class PcieLink:
    """A GPU's PCIe link; -1 where unknown."""

    gen: int  # the generation now (lower while the GPU idles: power saving, not a fault)
    max_gen: int  # the highest this card and its slot reach together
    width: int  # lanes now
    max_width: int  # lanes the card has

    @property
    def narrowed(self) -> bool:
        """Fewer lanes than the card has: a smaller slot, a riser, a lane-sharing board, a bad contact."""
        return 0 < self.width < self.max_width

    def describe(self) -> str:
        """ "PCIe 4.0 x16", or "PCIe 4.0 x4 of x16" when narrowed; the generation the link reaches, not today's."""
        gen = self.max_gen if self.max_gen > 0 else self.gen
        version = f"PCIe {gen}.0" if gen > 0 else "PCIe"
        if self.width <= 0:
            return f"{version} x{self.max_width}" if self.max_width > 0 else version
        return f"{version} x{self.width}" + (f" of x{self.max_width}" if self.narrowed else "")


def parse_p2p(text: str) -> dict[int, dict[int, str]]:
    """``nvidia-smi topo -p2p r``'s matrix (the same layout as topo -m's GPU columns: " GPU0\\tX\\tOK\\t"): each
    pair's status by physical id, as printed (OK, CNS, GNS, TNS, DR, NS, U); cells outside the legend are left out."""
    return {
        row: {other: cell for other, cell in cells.items() if cell in links.P2P_WORDS}
        for row, cells in links.parse_matrix(text).links.items()
    }


def read_p2p(run: Callable[[list[str]], str]) -> dict[int, dict[int, str]]:
    """Ask ``nvidia-smi topo -p2p r``; {} when it fails (a driver without -p2p answers an error, exit code 2)."""
    try:
        return parse_p2p(run(P2P_ARGV))
    except _FAILED:
        return {}


def read_nvml_p2p(pynvml: Any, handles: Mapping[int, Any]) -> dict[int, dict[int, str]]:
    """Each ordered pair's P2P read status from NVML (nvmlDeviceGetP2PStatus), as topo -p2p r prints it; a pair
    NVML cannot tell is left out, {} without the call (old pynvml)."""
    status_of = getattr(pynvml, "nvmlDeviceGetP2PStatus", None)
    found: dict[int, dict[int, str]] = {}
    if status_of is None:
        return found
    for a, b in itertools.permutations(handles, 2):
        try:
            status = status_of(handles[a], handles[b], _P2P_READ)
        except pynvml.NVMLError:
            continue
        found.setdefault(a, {})[b] = links.P2P_NVML[status] if 0 <= status < len(links.P2P_NVML) else "U"
    return found


def _number(cell: str) -> int:
    return int(cell) if cell.strip().isdigit() else -1  # "[N/A]", "[Not Supported]"


def parse_pcie(text: str) -> dict[int, PcieLink]:
    """``PCIE_ARGVS``' answer, "0, 4, 4, 16, 16" per GPU (index, generation now, its maximum, width now, its
    maximum): each GPU's link by physical id; rows in another shape (an error, "No devices were found") left out."""
    found = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5 and parts[0].isdigit():
            found[int(parts[0])] = PcieLink(*(_number(p) for p in parts[1:]))
    return found


def read_pcie(run: Callable[[list[str]], str]) -> dict[int, PcieLink]:
    """Ask nvidia-smi for each GPU's PCIe link, by the current field name and then the older one; {} when neither
    answers (the fields are unknown, and nothing fails)."""
    for argv in PCIE_ARGVS:
        try:
            return parse_pcie(run(argv))
        except _FAILED:
            continue
    return {}


def read_nvml_pcie(pynvml: Any, handle: Any) -> PcieLink | None:
    """A GPU's PCIe link from NVML; None when NVML tells none of it (old pynvml, a GPU without PCIe)."""
    names = ("CurrPcieLinkGeneration", "MaxPcieLinkGeneration", "CurrPcieLinkWidth", "MaxPcieLinkWidth")
    values = []
    for name in names:
        call = getattr(pynvml, f"nvmlDeviceGet{name}", None)
        try:
            values.append(int(call(handle)) if call else -1)
        except pynvml.NVMLError:
            values.append(-1)
    return None if all(v < 0 for v in values) else PcieLink(*values)
