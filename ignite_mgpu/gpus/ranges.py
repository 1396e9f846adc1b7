"""``--gpus auto:MIN-MAX``, an elastic job's range of GPUs: its grammar, and how many GPUs a job on it takes from a
snapshot (as many free ones as there are, at least MIN, at most MAX). Pure and torch-free; ``selection.parse_gpus``
reads the form, ``selection.plan_gpus`` chooses the GPUs, the supervisor leaves out a lost one (not below MIN)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ignite_mgpu.gpus.inventory import GpuInfo

_FORM = re.compile(r"auto:(\d+)-(\d+)", re.ASCII)
# The most GPUs a range may name: what every reader of a range (the holder files, `ignite-mgpu devices`) accepts.
MAX_GPUS = 9999


@dataclass(frozen=True)
class GpuRange:
    """At least ``low``, at most ``high`` GPUs, one process each; printed as it is written after ``auto:``."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"

    def count(self, gpus: list[GpuInfo], unavailable: Mapping[int, str]) -> int:
        """How many GPUs a job on this range takes now: the free ones (no other job's claim, no compute process,
        not in MIG mode), at least ``low`` (then some busy ones, as ``auto:low`` would take them), at most ``high``."""
        free = [g for g in gpus if not g.mig and g.index not in unavailable and g.n_processes == 0]
        return min(self.high, max(self.low, len(free)))


def parse_range(text: str) -> GpuRange | str | None:
    """``auto:MIN-MAX`` (``text`` lower-cased, stripped) as a GpuRange; a string says why the form is wrong (for
    ``parse_gpus``'s one-paragraph error); None when ``text`` is not of this form at all."""
    m = _FORM.fullmatch(text)
    if m is None:
        return None
    # Past 9 digits a number is only "too many": Python refuses to read one of 4300 digits.
    low, high = (int(digits) if len(digits) <= 9 else 10**9 for digits in (m[1], m[2]))
    if low < 1:
        return "auto:MIN-MAX needs MIN >= 1 (use --gpus none to train on the CPU)"
    if low > high:
        return f"auto:MIN-MAX needs MIN <= MAX, got MIN {low} > MAX {high} (e.g. auto:{high}-{low})"
    if high > MAX_GPUS:
        got, low = m[2] if len(m[2]) <= 12 else f"{m[2][:12]}...", min(low, MAX_GPUS)
        return f"auto:MIN-MAX takes MAX up to {MAX_GPUS}, got {got} (auto:{low}-{MAX_GPUS}: every free GPU from {low})"
    return GpuRange(low, high)


def written_range(value: object) -> str:
    """An elastic job's "MIN-MAX" as another job's holder file writes it, checked as ``parse_range`` checks a
    ``--gpus`` value; "" for anything else (the file is not trusted)."""
    if not isinstance(value, str) or not value.isascii() or len(value) > 20:
        return ""
    return value if isinstance(parse_range(f"auto:{value}"), GpuRange) else ""


def gpu_range(spec: str | None) -> GpuRange | None:
    """The range of a ``--gpus`` value already checked (``parse_gpus``); None for every other form."""
    found = parse_range(spec.strip().lower()) if spec is not None else None
    return found if isinstance(found, GpuRange) else None
