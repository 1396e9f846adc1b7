"""What a worker shares with a torchrun-started process beyond its rank: the run's id (env/cluster.py), and the
error file that torch's @record fills and the failure report reads (processes/attempt_files.py); and the one
paragraph for launch() at a script's top level. `python -m pytest tests/processes/test_attempt_files.py`."""

import json
import signal

import pytest

from ignite_mgpu.env import cluster
from ignite_mgpu.errors import FAILED, USAGE
from ignite_mgpu.processes import attempt_files
from ignite_mgpu.processes.notebook import NO_MAIN_GUARD
from ignite_mgpu.processes.outcome import no_restart_reason, outcome


def recorded(path, monkeypatch) -> None:
    """The error file as torch's @record writes it (its ErrorHandler, for an uncaught ValueError)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("the batch on rank 1 is corrupt")
    except ValueError as err:
        ErrorHandler().record_exception(err)


def test_the_run_id_is_the_schedulers_job_else_one_of_its_own_on_one_node():
    assert cluster.run_id({"SLURM_JOB_ID": "4242"}, nnodes=2) == "4242"
    ours = cluster.run_id({}, nnodes=1)
    assert len(ours) == 32 and ours != cluster.run_id({}, nnodes=1)  # as torchrun --standalone: a fresh one
    assert cluster.run_id({}, nnodes=2) == "none"  # as torchrun without --rdzv-id: the nodes could not agree


def test_the_error_file_that_record_writes_is_read_as_a_failure(tmp_path, monkeypatch):
    recorded(tmp_path / "error1.json", monkeypatch)
    found = attempt_files.read_error_file(tmp_path / "error1.json")
    assert found is not None
    assert (found["type"], found["message"]) == ("ValueError", "the batch on rank 1 is corrupt")
    assert found["traceback"].startswith("Traceback (most recent call last):")
    assert 'raise ValueError("the batch on rank 1 is corrupt")' in found["traceback"]
    assert found["time"] > 0


@pytest.mark.parametrize(
    "content",
    ["", "{not json", "[]", '{"message": 3}', '{"other": {}}'],
)
def test_an_unreadable_error_file_is_no_error_file(tmp_path, content):
    (tmp_path / "error0.json").write_text(content)
    assert attempt_files.read_error_file(tmp_path / "error0.json") is None
    assert attempt_files.read_error_file(tmp_path / "missing.json") is None


def test_a_plain_message_is_taken_as_it_is(tmp_path):
    (tmp_path / "error0.json").write_text(json.dumps({"message": "rank 0 lost its disk", "timestamp": "17"}))
    found = attempt_files.read_error_file(tmp_path / "error0.json")
    assert found == {"type": "Error", "message": "rank 0 lost its disk", "traceback": "", "time": 17.0}


def test_the_report_shows_the_error_files_error_where_the_worker_saw_only_an_exit(tmp_path, monkeypatch):
    """The script caught its error and exited with sys.exit(1): the worker knows only the exit; @record's file
    names the error and its traceback, which the report shows, as torchrun's does."""
    recorded(tmp_path / "error1.json", monkeypatch)
    own = {
        "rank": 1,
        "time": 5.0,
        "type": "RuntimeError",
        "message": "train.py exited with code 1 (sys.exit)",
        "traceback": "",
        "code": FAILED,
        "user_error": False,
    }
    failures = attempt_files.with_error_files([own], tmp_path, failed_ranks=[1])
    assert failures == [{**own, "type": "ValueError", "message": "the batch on rank 1 is corrupt",
                         "traceback": failures[0]["traceback"]}]  # fmt: skip
    result = outcome(failures, [-signal.SIGKILL, 1])
    assert result.code == FAILED and result.cause == "rank 1 failed with ValueError: the batch on rank 1 is corrupt"
    assert 'raise ValueError("the batch on rank 1 is corrupt")' in result.details
    # A rank that wrote no failure file of its own (os._exit after @record): the error file alone.
    alone = attempt_files.with_error_files([], tmp_path, failed_ranks=[1])
    assert alone[0]["rank"] == 1 and alone[0]["type"] == "ValueError" and alone[0]["code"] == FAILED
    assert attempt_files.with_error_files([], tmp_path, failed_ranks=[0]) == []  # rank 0's file: none


def test_workers_that_met_launch_at_the_scripts_top_level_give_one_paragraph(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__file__="/home/me/train.py"))
    result = outcome([], [NO_MAIN_GUARD, NO_MAIN_GUARD])
    assert result.code == USAGE
    assert result.cause.startswith(
        'train.py calls launch() at its top level, without `if __name__ == "__main__":`. Each worker imports '
        "train.py to find the job function"
    )
    assert result.cause.endswith("at the end of train.py; the job function stays at the top level.")
    assert no_restart_reason([], [NO_MAIN_GUARD, NO_MAIN_GUARD]) == "the script has no main guard"


def test_a_failure_is_timed_when_it_left_the_innermost_job_not_when_the_worker_caught_it():
    import time

    err = ValueError("the batch on rank 1 is corrupt")
    attempt_files.mark_raised(err)  # launch() inside a script: the inner job's function raised first
    inner = time.time()
    time.sleep(0.01)
    attempt_files.mark_raised(err)  # the script's own job, later: the first time stays
    record = attempt_files.failure_record(1, err)
    assert record["time"] <= inner and record["type"] == "ValueError" and record["code"] == FAILED
    assert attempt_files.failure_record(0, KeyError("x"))["time"] >= inner  # never marked: when it was caught
