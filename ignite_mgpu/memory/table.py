"""How ``ignite-mgpu plan`` prints a memory plan: a table per strategy, or one JSON object for scripts."""

from __future__ import annotations

import dataclasses
import json

from ignite_mgpu.memory.budget import CUDA_CONTEXT, MemoryPlan, Row
from ignite_mgpu.text import size

COLUMNS = ("strategy", "procs", "batch", "params", "grads", "optimizer", "act/sample", "peak", "fits", "micro-batch")


def _cells(r: Row) -> list[str]:
    if r.note.startswith("needs"):
        return [r.strategy, "-", str(r.batch), size(r.params), size(r.grads), size(r.optimizer),
                size(r.activations_per_sample), size(r.peak), "-", r.note]  # fmt: skip
    micro = "-" if r.micro_batch is None else str(r.micro_batch)
    return [r.strategy, str(r.processes), str(r.batch), size(r.params), size(r.grads), size(r.optimizer),
            size(r.activations_per_sample), size(r.peak), "yes" if r.fits else "no", micro]  # fmt: skip


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table, with the memory it was fitted into, the notes of each strategy and the advice."""
    cap = plan.capacity
    local = -(-plan.global_batch // plan.processes)  # the largest share
    head = (
        f"memory plan: model {plan.model}, optimizer {plan.optimizer}, {plan.precision}, global batch "
        f"{plan.global_batch} over {plan.processes} process{'es' if plan.processes > 1 else ''} ({local} each)"
    )
    if cap.device == "cuda":
        free = ", ".join(size(f) for f in cap.free)
        where = f"free on {cap.where}: {free} (each less {size(CUDA_CONTEXT)} for CUDA's context)"
    else:
        where = f"on the CPU: {size(cap.free[0])} of RAM per process (the available RAM shared, less "
        where += f"{size(cap.reserve)} each for PyTorch itself)"
    rows = [list(COLUMNS), *(_cells(r) for r in plan.rows)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    notes = [f"  {r.strategy}: {r.note}" for r in plan.rows if r.note and not r.note.startswith("needs")]
    notes += [f"  dp: GPU 0 also holds {size(r.extra)} more than a replica (the whole batch's inputs, the gathered "
              "outputs and their gradient)" for r in plan.rows if r.strategy == "dp" and r.extra]  # fmt: skip
    notes += [f"  fsdp: largest gathered block {size(r.block)}" for r in plan.rows if r.strategy == "fsdp" and r.block]
    if kept := ", ".join(f"{r.strategy}: {size(r.snapshot)}" for r in plan.rows if r.snapshot):
        notes.append(f"  checkpoint.async_save: the background checkpoint's snapshot stays in RAM ({kept}), counted in "
                     "the fit")  # fmt: skip
    if plan.host_snapshot:
        of = f" (of {size(cap.host_ram)} available beside the processes)" if cap.host_ram else ""
        notes.append(f"  checkpoint.async_save: the background checkpoint's snapshot takes {size(plan.host_snapshot)} "
                     f"of pinned host RAM{of}, not GPU memory")  # fmt: skip
    if cap.device == "cpu" and (planned := [r for r in plan.rows if not r.note.startswith("needs")]):
        whole = planned[0]  # a CPU process holds PyTorch itself beside the step's tensors: what `top` shows
        notes.append(f"  {whole.strategy}: each process holds about {size(cap.reserve + whole.peak)} in all: PyTorch "
                     f"itself ({size(cap.reserve)}) and the step's peak ({size(whole.peak)})")  # fmt: skip
    heap = " (the C library's heap holds up to that much more than the tensors)" if cap.device == "cpu" else ""
    footer = (
        "Per process (dp: GPU 0), one training step measured on fake tensors on the CPU: nothing allocated.\n"
        f"The peak is within 15 % of a step measured on the CPU; a fit keeps {cap.margin * 100:.0f} % of the peak "
        f"free{heap}."
    )
    return "\n".join([head, where, "", *table, *(["", *notes] if notes else []), "", plan.advice, footer])


def to_json(plan: MemoryPlan) -> str:
    """The plan as one JSON object: bytes as integers, every row, the capacity and the advice."""
    return json.dumps(dataclasses.asdict(plan), indent=2)
