"""How messages write counts and lists of ids: one spelling everywhere. Torch-free, a leaf like errors.py."""

from __future__ import annotations

from collections.abc import Iterable


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, pluralised: (1, "process") -> "1 process", (2, "process") -> "2 processes"."""
    return f"{count} {noun}{'' if count == 1 else 'es' if noun.endswith('s') else 's'}"


def format_ids(ids: Iterable[int]) -> str:
    """Ids (GPUs, CPUs) as one list, sorted, runs of three or more as ranges: [0, 1, 2, 3, 8] -> "0-3,8",
    [2, 3] -> "2,3". The kernel's cpulist format and ``taskset -c`` read both forms."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) >= 3 else ",".join(map(str, r)) for r in runs)
