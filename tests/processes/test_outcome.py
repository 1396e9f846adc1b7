"""How a job ended, as a pure function of how each worker ended: one exit code and one message, and whether a
restart can cure it; what a failed worker writes. The real processes are in tests/faults.
`python -m pytest tests/processes/test_outcome.py`."""

import signal

import pytest

from ignite_mgpu.processes.attempt_files import failure_record
from ignite_mgpu.processes.outcome import last_words_failure, no_restart_reason, outcome
from tests.faults.faultmod import WATCHDOG


def summarize(*args, **kwargs):
    """The job's exit code and the message printed for it."""
    result = outcome(*args, **kwargs)
    return result.code, result.message()


def report(rank, code, message="", type_="RuntimeError", time=0.0, traceback="", user_error=False):
    return {
        "rank": rank,
        "code": code,
        "message": message,
        "type": type_,
        "time": time,
        "traceback": traceback,
        "user_error": user_error,
    }


def test_success():
    assert summarize([], [0, 0]) == (0, "")


def test_the_earliest_failure_is_the_cause_with_its_traceback_once():
    reports = [
        report(1, 1, "boom", time=1.0, traceback="Traceback ...\nRuntimeError: boom\n"),
        report(0, 1, "Connection closed by peer", time=2.0, traceback="Traceback ...\n"),
    ]
    code, message = summarize(reports, [1, 1], first_failure=(1, 1))
    assert code == 1
    assert message == "rank 1 failed with RuntimeError: boom\nTraceback ...\nRuntimeError: boom\n"


def test_a_killed_rank_is_named_with_its_signal():
    code, message = summarize([], [-9, 1], first_failure=(0, -signal.SIGKILL), rank_offset=4)
    assert code == 1
    assert message.startswith("rank 4 terminated with signal SIGKILL (the kernel's OOM killer")
    assert "--resume auto" in message
    assert "OOM" not in summarize([], [-15, 1], first_failure=(0, -signal.SIGTERM))[1]


def test_divergence_and_stops():
    assert summarize([report(0, 3, "non-finite loss at iteration 7 on rank 1")], [3, 3]) == (
        3,
        "training diverged: non-finite loss at iteration 7 on rank 1",
    )
    stopped = [report(r, 143, "stopped by SIGTERM at iteration 5; every rank stopped") for r in (0, 1)]
    assert summarize(stopped, [143, 143]) == (143, "stopped by SIGTERM at iteration 5; every rank stopped.")
    # The launcher got Ctrl-C and told the workers with SIGTERM: the message names what the user sent.
    assert summarize(stopped, [143, 143], signal_received=signal.SIGINT) == (
        130,
        "stopped by SIGINT at iteration 5; every rank stopped.",
    )
    assert summarize([], [None, None], signal_received=signal.SIGTERM) == (143, "stopped by SIGTERM.")


def test_a_collective_timeout_names_the_silent_rank():
    reports = [report(0, 1, "Timed out waiting 20000ms for recv\nmore", type_="DistBackendError", time=3.0)]
    code, message = summarize(reports, [1, -9], timeout=20)
    assert code == 1
    assert message == (
        "rank 0 timed out after 20 s (dist.timeout) waiting in a collective; rank(s) 1 stopped answering "
        "(stuck or hung). Error: Timed out waiting 20000ms for recv"
    )


def test_a_failure_without_a_report():
    assert summarize([], [0, 1]) == (1, "a rank exited with codes [0, 1].")


@pytest.mark.parametrize("err, code, has_traceback", [(RuntimeError("boom"), 1, True), (ValueError("cfg"), 1, True)])
def test_failure_record_of_a_failed_worker(err, code, has_traceback):
    try:
        raise err
    except Exception as caught:
        rep = failure_record(3, caught)
    assert (rep["rank"], rep["code"], rep["type"], rep["message"]) == (3, code, type(err).__name__, str(err))
    assert ("Traceback" in rep["traceback"]) == has_traceback
    assert rep["user_error"] is False


def test_failure_record_of_a_deliberate_stop_has_its_code_and_no_traceback():
    from ignite_mgpu.errors import ConfigError, TrainingInterrupted

    try:
        raise TrainingInterrupted(signal.SIGTERM, 4)
    except TrainingInterrupted as caught:
        rep = failure_record(0, caught)
    assert rep["code"] == 143 and rep["traceback"] == ""
    try:
        raise ConfigError("bad key")
    except ConfigError as caught:
        rep = failure_record(1, caught)
    assert rep["code"] == 1 and rep["traceback"] == ""  # a user error inside a running job: exit 1, no traceback
    assert rep["user_error"]  # a restart would meet it again


def test_an_nccl_watchdog_abort_names_the_ranks_that_never_arrived():
    # NCCL's watchdog aborts the waiting ranks (SIGABRT, no error file); the stuck one is killed after the grace.
    code, message = summarize([], [-signal.SIGABRT, -signal.SIGKILL, -signal.SIGABRT], (0, -signal.SIGABRT), timeout=60)
    assert code == 1
    assert message.startswith("rank(s) 0, 2 aborted (SIGABRT), which is how NCCL's watchdog ends a process whose ")
    assert "dist.timeout (60 s); rank(s) 1 never arrived (stuck or hung)" in message


def test_ranks_that_died_in_cpp_are_known_by_their_last_lines_and_the_failed_device_is_blamed():
    """On NCCL a rank whose GPU fell off the bus aborts after the watchdog's lines, without a failure file; the
    healthy ranks' watchdogs abort them in the same second, one of them sooner, reporting the lost peer."""
    abort = -signal.SIGABRT
    lost = last_words_failure(2, ["loss 0.41", *WATCHDOG.format(rank=2).splitlines()], 100.4, abort)
    peer = ["[rank0]: NCCL error: remote process exited or there was a network error, NCCL version 2.21.5"]
    healthy = last_words_failure(0, peer, 100.1, abort)
    assert lost is not None and lost["message"] == "CUDA error: unknown error" and lost["type"] == "SIGABRT"
    assert healthy is not None and healthy["message"].startswith("NCCL error: remote process exited")
    assert last_words_failure(1, ["epoch 1 | train_loss 0.41"], 100.0, -signal.SIGKILL) is None  # the OOM killer
    result = outcome([healthy, lost], [abort, -signal.SIGKILL, abort, 0], (0, abort))
    assert result.rank == 2 and result.failed == "rank 2" and "Process group watchdog" in result.details
    assert result.cause == "rank 2 died (SIGABRT, no Python clean-up) after writing: CUDA error: unknown error"
    assert no_restart_reason([healthy, lost], [abort, -signal.SIGKILL, abort, 0], (0, abort)) is None
    # The watchdog's own timeout is not a cause: the ranks that never arrived are, as without the lines.
    timeout = ["[rank0]:[E] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)"]
    waited = last_words_failure(0, timeout, 100.0, abort)
    assert waited is not None
    assert outcome([waited], [abort, -signal.SIGKILL], (0, abort)).cause.startswith("rank(s) 0 aborted (SIGABRT)")


# ----------------------------------------------------------------------------------------------- restarts


@pytest.mark.parametrize(
    "reports, exit_codes, first_failure, received, reason",
    [
        ([report(1, 1, "boom", traceback="T")], [1, 1], (1, 1), 0, None),  # an exception: a restart may cure it
        ([], [-9, 1], (0, -signal.SIGKILL), 0, None),  # killed (OOM killer, kill -9)
        ([report(0, 1, "Timed out waiting 5000ms", type_="DistBackendError")], [1, -9], (0, 1), 0, None),
        ([], [-signal.SIGABRT, -9], (0, -signal.SIGABRT), 0, None),  # NCCL's watchdog
        ([], [0, 1], (1, 1), 0, None),  # a crash without a report
        # The earliest error decides: the user error, not the peer that lost its connection later.
        (
            [report(1, 1, "no space", "CheckpointError", 1.0, user_error=True), report(0, 1, "closed", time=2.0)],
            [1, 1],
            (0, 1),
            0,
            "CheckpointError is an error in the configuration, the data or a checkpoint, which a restart would meet "
            "again",
        ),
        ([report(0, 3, "nan"), report(1, 3, "nan")], [3, 3], (0, 3), 0, "training diverged, and a restart from"),
        ([report(0, 143, "stopped")], [143, -9], (0, 143), 0, "the job was asked to stop"),
        ([report(0, 138, "stopped by SIGUSR1")], [138, 138], (0, 138), 0, "the job was asked to stop"),
        ([], [-9, -9], (0, -9), signal.SIGTERM, "the job was asked to stop"),
        ([], [-signal.SIGTERM, 1], (0, -signal.SIGTERM), 0, "a rank was stopped by SIGTERM"),
        ([], [0, 0], None, 0, "the job succeeded"),
    ],
    ids=[
        "raise",
        "kill",
        "timeout",
        "abort",
        "crash",
        "user",
        "diverged",
        "sigterm",
        "preempt",
        "signal",
        "term",
        "ok",
    ],
)
def test_what_a_restart_can_cure(reports, exit_codes, first_failure, received, reason):
    found = no_restart_reason(reports, exit_codes, first_failure, received)
    assert found == reason if reason is None else found.startswith(reason), found


def test_a_preemption_stop_has_its_own_code():
    stopped = [report(r, 138, "stopped by SIGUSR1 at iteration 6; every rank stopped") for r in (0, 1)]
    assert summarize(stopped, [138, 138]) == (138, "stopped by SIGUSR1 at iteration 6; every rank stopped.")
    assert summarize(stopped, [138, 138], signal_received=signal.SIGUSR1)[0] == 138


def test_the_failed_ranks_are_named_for_the_restart_line():
    assert outcome([], [-9, 1], (0, -signal.SIGKILL), rank_offset=2).failed == "rank 2"
    assert (
        outcome([report(1, 1, "boom", time=1.0), report(0, 1, "closed", time=2.0)], [1, 1], (0, 1)).failed == "rank 1"
    )
    timed_out = [report(0, 1, "Timed out waiting 5000ms", type_="DistBackendError")]
    assert outcome(timed_out, [1, -9, -9], (0, 1)).failed == "rank(s) 1, 2"  # the silent ones
    assert outcome([], [-signal.SIGABRT, -9], (0, -signal.SIGABRT)).failed == "rank(s) 1"
