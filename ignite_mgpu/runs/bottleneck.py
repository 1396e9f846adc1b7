"""Where the step's time goes, judged: from each rank's split of an iteration (data wait, forward and backward compute,
the wait for the gradient all-reduce, the optimizer; ``train/step/timing.py`` measures it), the slowest rank and its
cause, or what bounds the whole job, in words; nothing when nothing stands out. Pure and torch-free."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# A rank is named the slowest when its own work (data + compute + optimizer) exceeds the others' median by this share
# of the step: the others then spend as long waiting for it at the gradient sync.
SLOWER_SHARE = 0.20
# A balanced job is called bound by data (every rank's data wait) or by communication (the all-reduce wait of the rank
# that waits least, so that waiting for a slower rank does not count) from this share of the step on.
BOUND_SHARE = 0.30
BOUND_BY = ("data", "communication", "slowest_rank")  # metrics.jsonl's bound_by, or null


@dataclass(frozen=True)
class Split:
    """Each rank's milliseconds per iteration; ``comm`` holds NaN where the wait was not measured; ``step_ms``: the
    wall time per iteration."""

    data: Sequence[float]
    compute: Sequence[float]
    comm: Sequence[float]
    optimizer: Sequence[float]
    step_ms: float
    sharded: bool = False  # FSDP: the communication is its all-gathers (else DDP's gradient all-reduce)

    def own(self, rank: int) -> float:
        """A rank's own work: what the others wait for when it is the slowest."""
        return self.data[rank] + self.compute[rank] + self.optimizer[rank]


@dataclass(frozen=True)
class Verdict:
    slowest_rank: int | None  # the rank with the most own work (None on one process)
    bound_by: str | None  # one of BOUND_BY, or None: nothing stands out
    words: str  # one sentence for a person, "" when nothing stands out


def slowest_rank(split: Split) -> int | None:
    ranks = len(split.data)
    return max(range(ranks), key=split.own) if ranks > 1 else None


def comm_words(sharded: bool) -> tuple[str, str]:
    """The communication a step waits for, and the collective the other ranks wait in for a slow rank: DDP's
    gradient all-reduce, or FSDP's all-gathers (``sharded``)."""
    if sharded:
        return "FSDP's all-gathers of the parameters not hidden behind compute", "the all-gathers"
    return "the gradient all-reduce not hidden behind backward", "the all-reduce"


def comm_help(device: str, sharded: bool = False) -> str:
    """What helps a job whose step waits for its communication, on GPUs (``"cuda"``) or CPU processes."""
    options = [
        f"a larger batch per {'GPU' if device == 'cuda' else 'process'}",
        "gradient accumulation (train.grad_accum_steps)",
    ]
    if sharded:
        options.append("model.fsdp_reshard_after_forward=false (no gathers in backward, more memory)")
    if device == "cuda":
        options.append("GPUs linked by NVLink")
    listed = (
        options[0]
        if len(options) == 1
        else f"{', '.join(options[:-1])}{',' if len(options) > 2 else ''} or {options[-1]}"
    )
    return f"{listed} would help"


def judge(split: Split, device: str = "cuda") -> Verdict:
    """The slowest rank and its cause when it holds the others back, else a job bound by data or communication;
    ``device``: where the ranks train ("cuda" or "cpu"), for what helps."""
    step, slowest = max(split.step_ms, 1e-9), slowest_rank(split)
    if slowest is not None:
        others = [r for r in range(len(split.data)) if r != slowest]
        lead = split.own(slowest) - statistics.median(split.own(r) for r in others)
        if lead >= SLOWER_SHARE * step:
            return Verdict(slowest, "slowest_rank", _slow_rank_words(split, slowest, others))
    data = statistics.mean(split.data) / step
    measured = [c for c in split.comm if not math.isnan(c)]
    comm = min(measured) / step if measured else 0.0
    if max(data, comm) < BOUND_SHARE:
        return Verdict(slowest, None, "")
    if data >= comm:
        return Verdict(
            slowest,
            "data",
            f"bound by data: the ranks wait {data:.0%} of the step for their batches (raise data.num_workers; "
            "with workers already, the storage or the decoding is too slow: faster storage, or lighter decoding and "
            "augmentation)",
        )
    return Verdict(
        slowest,
        "communication",
        f"bound by communication: {comm_words(split.sharded)[0]} takes {comm:.0%} of the step "
        f"({comm_help(device, split.sharded)})",
    )


def _slow_rank_words(split: Split, slowest: int, others: list[int]) -> str:
    """Why ``slowest`` holds the others back: the part of its step that most exceeds theirs."""
    step = max(split.step_ms, 1e-9)
    parts = {"data": split.data, "compute": split.compute, "optimizer": split.optimizer}
    cause = max(parts, key=lambda p: parts[p][slowest] - statistics.median(parts[p][r] for r in others))
    if cause == "data":
        why = (
            f"it waits {split.data[slowest] / step:.0%} of its steps for data (raise data.num_workers, or look at "
            "its node's storage)"
        )
    else:
        mine, theirs = parts[cause][slowest], statistics.median(parts[cause][r] for r in others)
        what = "forward and backward take" if cause == "compute" else "optimizer step takes"
        why = (
            f"its {what} {mine:.1f} ms against {theirs:.1f} ms on the others (a slower or busier device: another "
            "process on it, lower clocks, heat, or more threads than its cores)"
        )
    waits = [split.comm[r] for r in others if not math.isnan(split.comm[r])]
    where = f" ({statistics.mean(waits) / step:.0%} of their step)" if waits else ""
    return f"rank {slowest} is the slowest: {why}; the other ranks wait for it in {comm_words(split.sharded)[1]}{where}"
