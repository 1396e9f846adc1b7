"""What starts after an attempt, one decision over how it ended (``decide_next``): nothing (the job ended, and why it
was not restarted), a restart after a failure that a restart can cure (after a backoff; on the GPUs left when one
of an elastic job's GPUs failed), or a start on other GPUs after a change of size (GPUs lent or taken back); and
the messages that say it. Every way to a new start goes through it. Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ignite_mgpu.errors import DIVERGED, FAILED
from ignite_mgpu.gpus import inventory
from ignite_mgpu.processes import elastic
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.elastic import Resize
from ignite_mgpu.processes.job import Restart
from ignite_mgpu.processes.outcome import Outcome
from ignite_mgpu.processes.plan import LaunchPlan

# Seconds before restart k: BACKOFF * 2**(k-1), at most MAX_BACKOFF.
BACKOFF, MAX_BACKOFF = 1.0, 30.0


@dataclass(frozen=True)
class NextStart:
    """What follows an attempt: the job ends (``plan`` is None; ``note`` says why it was not restarted, where it
    could have been), or it starts again on ``plan``, after ``delay`` seconds."""

    plan: LaunchPlan | None
    restarts: int  # the restarts after a failure, this one included (a change of size is none)
    delay: float = 0.0
    release: tuple[str, ...] = ()  # claims let go before it starts: a failed GPU's, the GPUs lent
    failed: tuple[str, ...] = ()  # GPUs left out as failed: never taken back
    resized_from: int | None = None  # the processes before, when it starts on another number of GPUs
    gpu_message: str = ""  # what the restart does about a failed GPU
    note: str = ""


def decide_next(
    ended: Ended,
    plan: LaunchPlan,
    restarts: int,
    resized: Resize | None = None,
    query: Callable[[], list[inventory.GpuInfo]] = inventory.query_gpus,
) -> NextStart:
    """The next start after ``ended``, of a job on ``plan`` restarted ``restarts`` times so far. ``resized``: the
    change of size its ranks stopped for (their checkpoints written). ``query``: the GPU snapshot, read only when
    a restart could leave out a failed GPU."""
    if resized is not None and ended.resized:
        return NextStart(
            plan.on_gpus(resized.names), restarts, release=resized.change.lend, resized_from=plan.world_size
        )
    reason, left_out = ended.reason, None
    if reason is None and restarts < plan.max_restarts:
        left_out = elastic.leave_out(plan, ended.failures, query)
        reason = left_out.refusal if left_out is not None else None
    if reason is not None or restarts >= plan.max_restarts:
        note = ""
        if plan.max_restarts and ended.outcome.code in (FAILED, DIVERGED):
            why = f"not restarted: {reason}" if reason else f"gave up after {restarts} restart(s)"
            note = f"{why} (dist.max_restarts={plan.max_restarts})."
        return NextStart(None, restarts, note=note)
    k = restarts + 1
    # One rank's death (the OOM killer, a lost node's process) restarts at once; a failure that comes back (and
    # every other failure) backs off, so that a failing job does not restart in a tight loop.
    delay = 0.0 if k == 1 and ended.outcome.died else min(MAX_BACKOFF, BACKOFF * 2 ** (k - 1))
    if left_out is None:
        return NextStart(plan, k, delay)
    if left_out.plan is None:  # a job without a range: told what a range would have done
        return NextStart(plan, k, delay, gpu_message=left_out.message)
    released = tuple(left_out.released)
    return NextStart(left_out.plan, k, delay, released, released, plan.world_size, left_out.message)


def restart_messages(start: NextStart, failure: Outcome, info: Restart, reached: int, max_restarts: int) -> list[str]:
    """What the log says of a restart: the failure (its advice is the restart), what was done about a failed GPU,
    and the restart: its number, when, what it resumes from and the iterations lost."""
    k = start.restarts
    # An attempt that failed before its ranks noted an iteration had still resumed where its checkpoint was.
    reached = max(reached, info.iteration)
    lost = f"; {reached - info.iteration} iteration(s) lost (every rank had completed iteration {reached})"
    after = f" after {failure.failed} failed" if failure.failed else ""
    when = "at once (one rank died)" if k == 1 and failure.died else f"in {start.delay:.0f} s"
    restart = (
        f"restart {k} of {max_restarts} (dist.max_restarts){after}, {when}: {info.where()}"
        f"{lost if info.resumes else ''}."
    )
    return [failure.message(advice=False), start.gpu_message, restart]


def resize_where(info: Restart) -> str:
    """What a job that changed its size goes on from."""
    if info.checkpoint:
        return f"resuming from {info.checkpoint} at iteration {info.iteration}"
    return "from the start (no checkpoint yet)"
