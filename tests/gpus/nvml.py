"""A stand-in pynvml for the snapshot's tests (``monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(...))``): the
calls every snapshot makes, answering as NVML does for ``count`` idle GPUs (handles are the indices), and whatever a
test adds or replaces by name (``nvmlDeviceGetP2PStatus=...``)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


class NVMLError(Exception):
    """pynvml's error class: what the stand-in's calls raise, as the real ones raise ``pynvml.NVMLError``."""


def fake_pynvml(count: int, name: str, bus: Callable[[Any], Any], total_mib: int, **calls: Any) -> Any:
    """NVML with ``count`` GPUs named ``name``, GPU h on PCI bus ``bus(h)``, ``total_mib`` of memory each, none used,
    no processes, idle; ``calls`` add to or replace these."""
    return types.SimpleNamespace(
        **{
            "NVMLError": NVMLError,
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: count,
            "nvmlDeviceGetHandleByIndex": lambda i: i,
            "nvmlDeviceGetName": lambda h: name,
            "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(busId=bus(h)),
            "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=0, total=total_mib * 2**20),
            "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=0),
            "nvmlDeviceGetComputeRunningProcesses": lambda h: [],
            **calls,
        }
    )
