"""P2P and the PCIe link on real GPUs (the twins of tests/gpus/test_pcie.py, which read recorded outputs): this
driver's nvidia-smi knows the PCIe fields the snapshot asks for and agrees with NVML on each card's maximum, and with
two GPUs or more ``topo -p2p r`` and NVML's P2P status say the same of every pair.
`python -m pytest -m gpu tests/gpu/test_pcie.py`; they skip on a machine without CUDA (or without pynvml)."""

from __future__ import annotations

import pytest

from tests.conftest import needs_gpus

pytestmark = pytest.mark.gpu


def _nvml_handles():
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    return pynvml, {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())}


def test_nvidia_smi_answers_the_pcie_fields_as_nvml_does():
    from ignite_mgpu.gpus import inventory, pcie

    needs_gpus(1)
    by_smi = pcie.read_pcie(inventory._run_nvidia_smi)
    pynvml, handles = _nvml_handles()
    try:
        by_nvml = {i: pcie.read_nvml_pcie(pynvml, h) for i, h in handles.items()}
    finally:
        pynvml.nvmlShutdown()
    assert sorted(by_smi) == sorted(by_nvml) and all(link.max_width > 0 for link in by_smi.values()), by_smi
    # The current generation and width may change between the two questions (an idle GPU); the maxima may not.
    assert {i: (lk.max_gen, lk.max_width) for i, lk in by_smi.items()} == {
        i: (lk.max_gen, lk.max_width) for i, lk in by_nvml.items() if lk is not None
    }


def test_topo_p2p_and_nvml_say_the_same_of_every_pair():
    from ignite_mgpu.gpus import inventory, pcie

    needs_gpus(2)
    by_smi = pcie.read_p2p(inventory._run_nvidia_smi)
    pynvml, handles = _nvml_handles()
    try:
        by_nvml = pcie.read_nvml_p2p(pynvml, handles)  # the read capability by its number, which NVML accepts
    finally:
        pynvml.nvmlShutdown()
    assert by_smi and by_smi == by_nvml
