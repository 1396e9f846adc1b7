"""How a job ended, from how each of its workers ended: one exit code and one message (``outcome``), and whether a
restart can cure it (``no_restart_reason``). Pure functions of the workers' failure files and exit codes."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from ignite_mgpu.errors import DIVERGED, FAILED, SUCCESS, USAGE, signal_exit_code
from ignite_mgpu.gpus.health import device_error
from ignite_mgpu.hangs.hang_report import Hang
from ignite_mgpu.processes.notebook import NO_MAIN_GUARD, no_main_guard

# A worker's failure file (attempt_files.failure_record): rank, time, type, message, traceback, code.
Failure = dict[str, Any]


# The lines that name the error of a rank that died in C++, where no Python code wrote its failure file: NCCL's
# watchdog aborting the process after a CUDA error or a timeout, an exception escaping a C++ thread.
_LAST_WORDS = re.compile(
    r"CUDA error: .+|NCCL error.*|Watchdog caught collective operation timeout.*|what\(\):\s*\S.*|"
    r"terminate called after throwing .+",
    re.IGNORECASE,
)


def last_words_failure(rank: int, lines: list[str], at: float | None, code: int) -> Failure | None:
    """A failure record for a rank killed by signal ``-code`` that wrote no failure file, from the last ``lines`` it
    wrote to stderr (``at``: when it closed it), where they name an error; None where they name none (a rank killed
    by the OOM killer says nothing). The message is the CUDA error where there is one (NCCL's watchdog names it)."""
    named = [found[0] for line in lines if (found := _LAST_WORDS.search(line))]
    if not named:
        return None
    message = next((m for m in named if m.lower().startswith("cuda error")), named[-1])
    waited = "collective operation timeout" in message.lower()  # a peer never arrived: timed_out() tells
    return {
        "rank": rank,
        "time": at if at is not None else time.time(),
        "type": signal.Signals(-code).name + (" (watchdog timeout)" if waited else ""),
        "message": message,
        "traceback": "\n".join(lines),
        "code": FAILED,
        "user_error": False,
        "last_words": True,  # from its output, not a failure file of its own
    }


@dataclass
class Outcome:
    """How an attempt ended: the exit code, the cause (one sentence or the error), advice, the traceback, and the
    rank(s) that failed, for the restart's line."""

    code: int
    cause: str = ""
    advice: str = ""
    details: str = ""
    failed: str = ""  # "rank 1", "rank(s) 1, 3"
    rank: int | None = None  # the global rank whose error is the cause (None: not one rank's error)
    died: bool = False  # the cause is one rank killed by a signal that the launcher did not send

    def message(self, advice: bool = True) -> str:
        text = f"{self.cause} {self.advice}" if advice and self.advice else self.cause
        return f"{text}\n{self.details}" if self.details else text


def is_stop(code: int) -> bool:
    return code > 128  # 128 + N: stopped by signal N (SIGINT, SIGTERM, the pre-emption signal)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def outcome(
    failures: list[Failure],
    exit_codes: list[int | None],
    first_failure: tuple[int, int] | None = None,
    signal_received: int = 0,
    rank_offset: int = 0,
    timeout: float = 300.0,
) -> Outcome:
    """The job's exit code and what to tell the user, from how every worker ended.

    Args:
        failures: the failure files of the workers that failed (``attempt_files.failure_record``).
        exit_codes: every local worker's exit code (negative: killed by that signal).
        first_failure: (local rank, exit code) of the first worker that ended with a non-zero code.
        signal_received: the signal the launcher itself received (0: none).
        rank_offset: the global rank of local rank 0 (multi-node).
        timeout: ``dist.timeout``, named in the message for a collective that timed out.
    """
    stopped = [f for f in failures if is_stop(f["code"])]
    if signal_received:
        # The workers were told with SIGTERM; name the signal the user actually sent.
        name = signal.Signals(signal_received).name
        message = stopped[0]["message"].replace("SIGTERM", name) if stopped else f"stopped by {name}"
        return Outcome(signal_exit_code(signal_received), f"{message}.")
    if all(c == 0 for c in exit_codes):
        return Outcome(SUCCESS)
    if NO_MAIN_GUARD in exit_codes and not failures:
        return Outcome(USAGE, no_main_guard(getattr(sys.modules.get("__main__"), "__file__", None) or ""))
    if len(stopped) == len(exit_codes):  # every worker was signalled directly (e.g. by a scheduler)
        return Outcome(int(stopped[0]["code"]), f"{stopped[0]['message']}.")
    # A script rejected its arguments (ignite-mgpu run)
    usage = [f for f in failures if f["code"] == USAGE]
    if usage:
        first = min(usage, key=lambda f: f["time"])
        where = "" if len(usage) == len(exit_codes) else f"rank {first['rank']}: "
        return Outcome(USAGE, f"{where}{first['message']}", rank=first["rank"])
    diverged = [f for f in failures if f["code"] == DIVERGED]
    if diverged:
        return Outcome(DIVERGED, f"training diverged: {diverged[0]['message']}")
    said = [f for f in failures if f.get("last_words") and not timed_out(f)]
    if said:
        return _died_saying(said)
    if first_failure and first_failure[1] == -signal.SIGABRT and all(f.get("last_words") for f in failures):
        return _watchdog_abort(exit_codes, rank_offset, timeout)
    # Killed (OOM killer, kill -9): no failure file of its own.
    if first_failure and first_failure[1] < 0:
        return _killed(first_failure, rank_offset)
    return _raised([f for f in failures if f["code"] == FAILED], exit_codes, rank_offset, timeout)


def _watchdog_abort(exit_codes: list[int | None], rank_offset: int, timeout: float) -> Outcome:
    # NCCL's watchdog aborts a process whose collective outlived the timeout (no failure file is written): the
    # ranks that aborted were waiting; the silent ones, those that did not abort, are what to look at.
    aborted = [rank_offset + i for i, c in enumerate(exit_codes) if c == -signal.SIGABRT]
    silent = [rank_offset + i for i, c in enumerate(exit_codes) if c != -signal.SIGABRT]
    return Outcome(
        FAILED,
        f"rank(s) {_ranks(aborted)} aborted (SIGABRT), which is how NCCL's watchdog ends a process whose collective "
        f"waited longer than dist.timeout ({timeout:.0f} s); rank(s) {_ranks(silent) or '?'} never arrived (stuck "
        "or hung).",
        "Find what they were doing (data loader, I/O, a rank-dependent branch); --resume auto continues from "
        "the last checkpoint.",
        failed=f"rank(s) {_ranks(silent)}",
    )


def _died_saying(said: list[Failure]) -> Outcome:
    """Ranks killed in C++ after writing an error: the cause is a failed device where one names it (under NCCL the
    healthy ranks abort in the same second, their watchdogs reporting the lost peer), else the first to die."""
    first = min(said, key=lambda f: (device_error(f["message"]) is None, f["time"]))
    return Outcome(
        FAILED,
        f"rank {first['rank']} died ({first['type']}, no Python clean-up) after writing: {first['message']}",
        "Its last lines are below; --resume auto continues from the last checkpoint.",
        first["traceback"],
        failed=f"rank {first['rank']}",
        rank=first["rank"],
    )


def _killed(first_failure: tuple[int, int], rank_offset: int) -> Outcome:
    local_rank, code = first_failure
    hint = " (the kernel's OOM killer sends SIGKILL when memory runs out)" if code == -signal.SIGKILL else ""
    return Outcome(
        FAILED,
        f"rank {rank_offset + local_rank} terminated with signal {signal.Signals(-code).name}{hint}; stopped "
        "the other ranks.",
        "Resume from the last checkpoint with --resume auto.",
        failed=f"rank {rank_offset + local_rank}",
        rank=rank_offset + local_rank,
    )


def timed_out(failure: Failure) -> bool:
    """Whether a rank's failure is a collective that waited past dist.timeout."""
    return "timed out" in failure["message"].lower() or "timeout" in failure["type"].lower()


def _raised(failed: list[Failure], exit_codes: list[int | None], rank_offset: int, timeout: float) -> Outcome:
    """The job's ending when ranks raised: a collective that timed out on every failed rank, or the first error."""
    timeouts = [f for f in failed if timed_out(f)]
    if failed and len(timeouts) == len(failed):
        waiting = {f["rank"] for f in timeouts}
        silent = [rank_offset + i for i in range(len(exit_codes)) if rank_offset + i not in waiting]
        first = min(timeouts, key=lambda f: f["time"])
        return Outcome(
            FAILED,
            f"rank {first['rank']} timed out after {timeout:.0f} s (dist.timeout) waiting in a collective; "
            f"rank(s) {_ranks(silent) or '?'} stopped answering (stuck or hung). "
            f"Error: {first['message'].splitlines()[0] if first['message'] else ''}",
            failed=f"rank(s) {_ranks(silent)}",
        )
    if failed:
        # The earliest error is the cause; later ones are usually peers losing their connection to it.
        first = min(failed, key=lambda f: f["time"])
        cause = f"rank {first['rank']} failed with {first['type']}: {first['message']}"
        return Outcome(FAILED, cause, "", first["traceback"], f"rank {first['rank']}", first["rank"])
    return Outcome(FAILED, f"a rank exited with codes {exit_codes}.")


def no_restart_reason(
    failures: list[Failure],
    exit_codes: list[int | None],
    first_failure: tuple[int, int] | None = None,
    signal_received: int = 0,
) -> str | None:
    """None when a restart can cure how the attempt ended (an exception that is not a user error, a crash, a
    rank killed, a collective timeout); otherwise why not, for the log."""
    if signal_received or any(is_stop(f["code"]) for f in failures):
        return "the job was asked to stop"
    if all(c == 0 for c in exit_codes):
        return "the job succeeded"
    if any(f["code"] == USAGE for f in failures):
        return "the script rejected its arguments, and a restart would give it the same ones"
    if NO_MAIN_GUARD in exit_codes and not failures:
        return "the script has no main guard"
    if any(f["code"] == DIVERGED for f in failures):
        return "training diverged, and a restart from the last checkpoint would diverge again"
    if first_failure and first_failure[1] in (-signal.SIGINT, -signal.SIGTERM):
        return f"a rank was stopped by {signal.Signals(-first_failure[1]).name}"
    if first_failure and first_failure[1] < 0:
        return None  # killed: the kernel's OOM killer, kill -9, NCCL's watchdog
    failed = sorted((f for f in failures if f["code"] == FAILED), key=lambda f: f["time"])
    if failed and failed[0].get("user_error"):
        return (
            f"{failed[0]['type']} is an error in the configuration, the data or a checkpoint, which a restart "
            "would meet again"
        )
    return None


def refused_start(local_rank: int, nproc: int, err: BaseException) -> str:
    """The machine refused to start worker ``local_rank`` of ``nproc`` (fork's EAGAIN: the per-user process limit or
    memory), as one paragraph."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return (
        f"could not start process {local_rank + 1} of {nproc}: this machine refused a new process ({what}); the "
        f"per-user process limit (ulimit -u: {limit}) or the memory ran out. Lower --nproc (this machine has "
        f"{os.cpu_count()} CPUs) or raise the limit; nothing was trained."
    )


def server_died(result: Outcome, how: str | None) -> Outcome:
    """The workers' failure when the fork server that forked them died (``how``: "was killed by SIGKILL"; None: it
    runs): they died with it, and their exit codes (255 each) say nothing; the server's death is the cause."""
    if how is None or result.rank is not None:
        return result
    return Outcome(
        FAILED,
        f"the fork server, which forks this job's workers, {how} (the OOM killer, or a kill by hand), and every "
        "worker died with it.",
        "--max-restarts restarts the job on a new one; --resume auto continues from the last checkpoint.",
    )


def cut_short_while_saving(result: Outcome, saving: bool) -> Outcome:
    """A stop cut short (a second signal, or the grace ran out) while a rank was writing a checkpoint (the stop's, or
    one due before it): that checkpoint was never written, so the message must not name an iteration as if the job
    had stopped there with its checkpoint."""
    if not saving or not is_stop(result.code):
        return result
    head = re.sub(r" at iteration \d+.*", "", result.cause.rstrip(".")) or "stopped"
    return dataclasses.replace(
        result,
        cause=f"{head}, at once, while a checkpoint was being written: it was not written.",
        advice="--resume auto continues from the last complete checkpoint.",
    )


def cut_short_before_stop(result: Outcome, why: str) -> Outcome:
    """A stop of the default job cut short (``why``: a second signal, the grace ran out) before any rank stopped by
    itself and none was writing a checkpoint: the stop's checkpoint was skipped, which the last line says, with the
    way on."""
    if not is_stop(result.code):
        return result
    head = re.sub(r" at iteration \d+.*", "", result.cause.rstrip(".")) or "stopped"
    skipped = "before the ranks stopped by themselves: the stop's checkpoint was not written"
    return dataclasses.replace(
        result,
        cause=f"{head}, at once ({why}), {skipped}.",
        advice="--resume auto continues from the last complete checkpoint.",
    )


def stop_message(signum: int, join_group: bool, grace: float, starting: bool) -> str:
    """The line saying how a job stops on the signal ``signum`` (received first): the default job's ranks stop at
    the next check (a pre-emption also writes a checkpoint and requeues); a script is sent the signal itself, as
    torchrun passes it on (SIGINT: KeyboardInterrupt), its own handler deciding, SIGKILL after the grace."""
    name_of = signal.Signals(signum).name
    preempt = signum not in (signal.SIGINT, signal.SIGTERM)
    name = f"{name_of} received{' (pre-emption)' if preempt else ''}"
    if starting:
        return f"{name} while the workers start: they are stopped at once."
    within = f" (up to {grace:.0f} s)"
    if preempt:
        what = "stops and writes a checkpoint at the next check" if join_group else f"is sent {name_of}"
        what += f"{within}; the job then requeues itself"
    else:
        what = "stops at the next check" if join_group else f"is sent {name_of}"
        what += within if join_group else f" (then SIGKILL after {grace:.0f} s)"
    return f"{name}: every rank {what}; press Ctrl-C again to stop at once."


def with_hang(result: Outcome, hang: Hang, stopped: bool) -> Outcome:
    """The attempt's outcome with where every rank was: a hang found by the watch is the cause (unless the job
    was asked to stop: its ending stays a stop); otherwise the lines follow the cause (a timeout, a stop)."""
    where = "\n".join([f"Where each rank was (rank(s) {', '.join(map(str, hang.stuck))} stuck):", *hang.lines])
    tail = f"{where}\nEvery rank's stacks: {hang.path}"
    details = "\n".join(filter(None, [result.details, tail]))
    if hang.cause is not None and not stopped:
        return Outcome(
            FAILED,
            hang.cause,
            "Look at what the stuck rank(s) wait for (data, I/O, a rank-dependent branch); --resume auto continues "
            "from the last checkpoint; dist.hang_seconds sets the watch's shortest window (0: off).",
            details,
            failed=f"rank(s) {', '.join(map(str, hang.stuck))}",
        )
    return dataclasses.replace(result, details=details)
