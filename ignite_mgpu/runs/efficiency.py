"""``ignite-mgpu scale``'s numbers: each size's measured epoch (``Size``, from its ``metrics.jsonl`` line), the
speed-up and scaling efficiency against one process, where the time lost against perfect scaling went, part by part
of the step (``losses``), the verdict in words and the table. Pure and torch-free."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from ignite_mgpu.runs.bottleneck import Split, comm_help, comm_words, judge

# From this efficiency on, a size scales well: nothing is named as lost.
SCALES_WELL = 0.9
PARTS = ("compute", "communication", "waiting", "data", "optimizer", "other")
# The table's columns of the step, ms per iteration (the mean of the ranks).
_COLUMNS = (("compute", "compute"), ("comm", "comm"), ("data", "data"), ("optimizer", "optimizer"))


@dataclass(frozen=True)
class Size:
    """One size's measured epoch: its devices (processes; GPUs of one DataParallel process), global batch, samples
    per second, and each rank's step split (ms per iteration; ``comm`` NaN where not measured)."""

    devices: int
    global_batch: int
    samples_per_s: float
    split: Split
    bound_by: str | None = None

    @classmethod
    def from_line(cls, devices: int, global_batch: int, line: dict[str, Any], sharded: bool = False) -> Size:
        """From the epoch's line as ``metrics.jsonl`` has it (``EpochLog``); ``sharded``: FSDP's (its communication is
        its all-gathers)."""
        ranks = line.get("processes", 1)
        parts = {k: line.get(f"time_{k}_ms") or [math.nan] * ranks for k in ("data", "compute", "comm", "optimizer")}
        comm = [math.nan if c is None else float(c) for c in parts["comm"]]
        step = float(line["time_per_iter_ms"])
        split = Split(parts["data"], parts["compute"], comm, parts["optimizer"], step, sharded)
        return cls(devices, global_batch, float(line["samples_per_s"]), split, line.get("bound_by"))

    @property
    def per_device(self) -> float:
        return self.global_batch / self.devices

    def mean(self, part: str) -> float:
        """A part's mean over the ranks, ms per iteration; the all-reduce where it is not measured: 0."""
        values = [0.0 if math.isnan(v) else v for v in getattr(self.split, part)]
        return statistics.mean(values)

    @property
    def other(self) -> float:
        """The rest of the step: the loop's handlers and checks, outside forward, backward and the optimizer."""
        parts = sum(self.mean(p) for p in ("data", "compute", "comm", "optimizer"))
        return max(0.0, self.split.step_ms - parts)

    @property
    def comm_measured(self) -> bool:
        return not all(math.isnan(c) for c in self.split.comm)


def speedup(base: Size, at: Size) -> float:
    return at.samples_per_s / base.samples_per_s if base.samples_per_s else math.nan


def efficiency(base: Size, at: Size) -> float:
    """The speed-up per added device: 1.0 is perfect scaling."""
    return speedup(base, at) / (at.devices / base.devices)


def losses(base: Size, at: Size) -> dict[str, float]:
    """Where ``at``'s step lost time against perfect scaling from ``base`` (one process), ms per iteration, part by
    part (``PARTS``); they sum to the step's time beyond the ideal (``base``'s step, scaled by the batch per device).
    ``communication``: the all-reduce itself (the rank that waits least); ``waiting``: the other ranks' extra wait at
    it, for a slower rank; the other parts: their growth over the ideal."""
    scale = at.per_device / base.per_device
    measured = [c for c in at.split.comm if not math.isnan(c)]
    least = min(measured) if measured else 0.0
    lost = {
        "compute": at.mean("compute") - scale * base.mean("compute"),
        "communication": least - scale * base.mean("comm"),
        "waiting": at.mean("comm") - least,
        "data": at.mean("data") - scale * base.mean("data"),
        "optimizer": at.mean("optimizer") - scale * base.mean("optimizer"),
        "other": at.other - scale * base.other,
    }
    return lost


def verdict(base: Size, at: Size, device: str) -> str:
    """One line: the speed-up and efficiency of ``at`` over one process, and, below ``SCALES_WELL``, the part that
    lost the most time and what helps."""
    gain, eff = speedup(base, at), efficiency(base, at)
    said = (
        f"{at.devices} {_units(at, device)}: {gain:.2f}x the samples/s of {base.devices} ({eff:.0%} scaling efficiency)"
    )
    if eff >= SCALES_WELL:
        return f"{said}: it scales well"
    lost = losses(base, at)
    part = max(lost, key=lambda p: lost[p])
    what, helps = _lost_words(part, at, device)
    return (
        f"{said}; the time lost is mostly {what} ({lost[part]:.1f} ms of the {at.split.step_ms:.1f} ms step): {helps}"
    )


def _units(at: Size, device: str) -> str:
    return ("GPU" if device == "cuda" else "process") + ("" if at.devices == 1 else "s" if device == "cuda" else "es")


def _lost_words(part: str, at: Size, device: str) -> tuple[str, str]:
    """What a part is, and what helps, for the verdict."""
    if part == "communication":
        return comm_words(at.split.sharded)[0], comm_help(device, at.split.sharded)
    if part == "waiting":
        return f"waiting in {comm_words(at.split.sharded)[1]} for a slower rank", judge(
            at.split, device
        ).words or "see each rank's split"
    if part == "data":
        return (
            "the wait for batches",
            "raise data.num_workers; with workers already, faster storage or lighter decoding",
        )
    if part == "compute" and device == "cpu":
        return "forward and backward, slower than on one process", (
            "the processes share the machine's cores, which one process used alone through its threads: on the "
            "CPU more processes help only where one process leaves cores idle"
        )
    if part == "compute":
        return "forward and backward, slower than on one GPU alone", (
            "a GPU held back by its clocks, power or heat, a GPU shared with another job (ignite-mgpu devices), or "
            "too few CPU cores to launch every GPU's kernels (--cpu-binding)"
        )
    return f"the {'optimizer step' if part == 'optimizer' else 'rest of the step (the loop, its checks)'}", (
        "it does not shrink with the batch per device: a larger batch per device, or train.grad_accum_steps"
    )


def table(sizes: list[Size], device: str) -> str:
    """The sizes, one line each: devices, global batch, samples/s, speed-up, efficiency, then where the step's time
    goes (ms per iteration, the mean of the ranks) and what bounds it."""
    unit = "GPUs" if device == "cuda" else "processes"
    head = f"{unit:>9}  {'batch':>6}  {'samples/s':>9}  {'speed-up':>8}  {'efficiency':>10}"
    comm = "all-gather" if any(at.split.sharded for at in sizes) else "all-reduce"  # FSDP's, or DDP's
    head += (
        "".join(f"  {comm if part == 'comm' else name:>10}" for name, part in _COLUMNS) + f"  {'other':>7}  bound by"
    )
    lines = [head]
    for at in sizes:
        row = f"{at.devices:>9}  {at.global_batch:>6}  {at.samples_per_s:>9.0f}  {speedup(sizes[0], at):>7.2f}x"
        row += f"  {efficiency(sizes[0], at):>10.0%}"
        for _, part in _COLUMNS:
            shown = "-" if part == "comm" and not at.comm_measured and at.devices > 1 else f"{at.mean(part):.2f}"
            row += f"  {shown:>10}"
        bound = at.bound_by.replace("slowest_rank", f"rank {_slowest(at)}") if at.bound_by else "-"
        lines.append(f"{row}  {at.other:>7.2f}  {bound}")
    lines.append(f"(the step's parts in ms per iteration, the mean of the ranks; {comm}: the wait for it)")
    return "\n".join(lines)


def _slowest(at: Size) -> int | None:
    return judge(at.split).slowest_rank


def as_json(sizes: list[Size]) -> list[dict[str, Any]]:
    """The sizes for ``--json``: each one's numbers and its lost time per part."""
    return [
        {
            "devices": at.devices,
            "global_batch": at.global_batch,
            "samples_per_s": at.samples_per_s,
            "time_per_iter_ms": at.split.step_ms,
            "speedup": round(speedup(sizes[0], at), 4),
            "efficiency": round(efficiency(sizes[0], at), 4),
            "step_ms": {p: round(at.mean(p), 3) for _, p in _COLUMNS} | {"other": round(at.other, 3)},
            "lost_ms": {p: round(v, 3) for p, v in losses(sizes[0], at).items()},
            "bound_by": at.bound_by,
        }
        for at in sizes
    ]
