"""The supervisor's outcome as a pure function: how each worker ended -> one exit code and one message. The real
processes are in tests/faults. `python -m pytest tests/test_supervisor.py`."""

import signal

import pytest

from ignite_mgpu.supervisor import summarize
from ignite_mgpu.worker import error_report


def report(rank, code, message="", type_="RuntimeError", time=0.0, traceback=""):
    return {"rank": rank, "code": code, "message": message, "type": type_, "time": time, "traceback": traceback}


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
def test_error_report_of_a_failed_worker(err, code, has_traceback):
    try:
        raise err
    except Exception as caught:
        rep = error_report(3, caught)
    assert (rep["rank"], rep["code"], rep["type"], rep["message"]) == (3, code, type(err).__name__, str(err))
    assert ("Traceback" in rep["traceback"]) == has_traceback


def test_error_report_of_a_deliberate_stop_has_its_code_and_no_traceback():
    from ignite_mgpu.errors import ConfigError, TrainingInterrupted

    try:
        raise TrainingInterrupted(signal.SIGTERM, 4)
    except TrainingInterrupted as caught:
        rep = error_report(0, caught)
    assert rep["code"] == 143 and rep["traceback"] == ""
    try:
        raise ConfigError("bad key")
    except ConfigError as caught:
        rep = error_report(1, caught)
    assert rep["code"] == 1 and rep["traceback"] == ""  # a user error inside a running job: exit 1, no traceback


def test_an_nccl_watchdog_abort_names_the_ranks_that_never_arrived():
    # NCCL's watchdog aborts the waiting ranks (SIGABRT, no error file); the stuck one is killed after the grace.
    code, message = summarize([], [-signal.SIGABRT, -signal.SIGKILL, -signal.SIGABRT], (0, -signal.SIGABRT), timeout=60)
    assert code == 1
    assert message.startswith("rank(s) 0, 2 aborted (SIGABRT), which is how NCCL's watchdog ends a process whose ")
    assert "dist.timeout (60 s); rank(s) 1 never arrived (stuck or hung)" in message
