"""The supervisor's restart loop with its attempts replaced by scripted outcomes. The real processes are in
tests/faults. `python -m pytest tests/processes/test_supervisor.py`."""

import dataclasses
import os
import signal
import time

import pytest

from ignite_mgpu.env import stop
from ignite_mgpu.processes import next_start, supervisor
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.job import Job, Restart
from ignite_mgpu.processes.outcome import Outcome
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.processes.supervisor import Supervisor


class Scripted(Supervisor):
    """A supervisor whose attempts end as scripted ((outcome, why no restart, iteration reached) each) instead of
    starting processes."""

    def __init__(self, plan, outcomes, restart=None):
        super().__init__(plan, Job(print, ("first",)), restart=restart)
        self.outcomes, self.started = list(outcomes), []

    def _run_attempt(self, spec, index):
        self.started.append(spec.job.args)
        return Ended(*self.outcomes.pop(0))


@pytest.fixture
def no_backoff(monkeypatch):
    monkeypatch.setattr(next_start, "BACKOFF", 0.0)


def killed(rank=1):
    return Outcome(
        1,
        f"rank {rank} terminated with signal SIGKILL (the kernel's OOM killer sends SIGKILL when memory runs "
        "out); stopped the other ranks.",
        "Resume from the last checkpoint with --resume auto.",
        failed=f"rank {rank}",
    )


def test_each_restart_is_logged_once_with_its_cause_checkpoint_and_loss(no_backoff, capsys):
    hook_calls = []

    def restart(attempt):
        hook_calls.append(attempt)
        return Restart(("again", attempt), "/out/checkpoint_4.pt", 4)

    boom = Outcome(
        1, "rank 0 failed with RuntimeError: boom", "", "Traceback (most recent call last):\n  ...\n", "rank 0"
    )
    sup = Scripted(
        LaunchPlan("gloo", 2, max_restarts=2),
        [(killed(), None, 7), (boom, None, 5), (Outcome(0), "the job succeeded", 20)],
        restart,
    )
    assert sup.run() == 0
    assert hook_calls == [1, 2] and sup.started == [("first",), ("again", 1), ("again", 2)]
    err = capsys.readouterr().err
    assert err == (
        "ignite-mgpu: rank 1 terminated with signal SIGKILL (the kernel's OOM killer sends SIGKILL when memory runs "
        "out); stopped the other ranks.\n"
        "ignite-mgpu: restart 1 of 2 (dist.max_restarts) after rank 1 failed, in 0 s: resuming from "
        "/out/checkpoint_4.pt at iteration 4; 3 iteration(s) lost (every rank had completed iteration 7).\n"
        "ignite-mgpu: rank 0 failed with RuntimeError: boom\nTraceback (most recent call last):\n  ...\n"
        "ignite-mgpu: restart 2 of 2 (dist.max_restarts) after rank 0 failed, in 0 s: resuming from "
        "/out/checkpoint_4.pt at iteration 4; 1 iteration(s) lost (every rank had completed iteration 5).\n"
    )


def test_a_restart_after_an_attempt_that_noted_no_iteration_counts_from_its_checkpoint(no_backoff, capsys):
    """The second attempt resumed at iteration 4 and failed before its ranks noted one: "0 iteration(s) lost (every
    rank had completed iteration 4)", not "... completed iteration 0" while resuming at 4."""
    sup = Scripted(
        LaunchPlan("gloo", 2, max_restarts=2),
        [(killed(), None, 6), (killed(), None, 0), (Outcome(0), "ok", 9)],
        lambda k: Restart(("again", k), "/out/checkpoint_4.pt", 4),
    )
    assert sup.run() == 0
    err = capsys.readouterr().err
    assert "at iteration 4; 2 iteration(s) lost (every rank had completed iteration 6)." in err
    assert "at iteration 4; 0 iteration(s) lost (every rank had completed iteration 4)." in err, err


def test_restarts_run_out_with_the_last_failure_reported_once(no_backoff, capsys):
    sup = Scripted(LaunchPlan("gloo", 2, max_restarts=1), [(killed(), None, 3), (killed(), None, 3)])
    assert sup.run() == 1
    err = capsys.readouterr().err
    assert err.count("rank 1 terminated with signal SIGKILL") == 2  # every failure, once each
    assert (
        "restart 1 of 1 (dist.max_restarts) after rank 1 failed, in 0 s: running the job function again from its start."
        in err
    )
    assert err.endswith(
        "stopped the other ranks. Resume from the last checkpoint with --resume auto.\n"
        "ignite-mgpu: gave up after 1 restart(s) (dist.max_restarts=1).\n"
    )


def test_a_failure_a_restart_cannot_cure_ends_the_job(no_backoff, capsys):
    user = Outcome(1, "rank 1 failed with CheckpointError: saving checkpoint_4.pt failed")
    sup = Scripted(LaunchPlan("gloo", 2, max_restarts=3), [(user, "CheckpointError is an error in ...", 3)])
    assert sup.run() == 1 and len(sup.started) == 1
    assert capsys.readouterr().err == (
        "ignite-mgpu: rank 1 failed with CheckpointError: saving checkpoint_4.pt failed\n"
        "ignite-mgpu: not restarted: CheckpointError is an error in ... (dist.max_restarts=3).\n"
    )
    sup = Scripted(LaunchPlan("gloo", 2), [(killed(), None, 3)])  # max_restarts=0: today's behaviour, no note
    assert sup.run() == 1 and len(sup.started) == 1
    assert "restart" not in capsys.readouterr().err


def test_a_stop_signal_during_the_backoff_cancels_the_restart(monkeypatch, capsys):
    monkeypatch.setattr(next_start, "BACKOFF", 30.0)
    sup = Scripted(LaunchPlan("gloo", 2, max_restarts=1), [(killed(), None, 3)])
    monkeypatch.setattr(supervisor.time, "sleep", lambda s: setattr(sup, "signal_received", signal.SIGTERM))
    assert sup.run() == 143 and len(sup.started) == 1
    assert capsys.readouterr().err.endswith("ignite-mgpu: stopped by SIGTERM before a restart.\n")
    resumes = Scripted(LaunchPlan("gloo", 2, max_restarts=1), [(killed(), None, 3)], lambda k: Restart((k,)))
    monkeypatch.setattr(supervisor.time, "sleep", lambda s: setattr(resumes, "signal_received", signal.SIGTERM))
    assert resumes.run() == 143  # a job that resumes its checkpoints is told how to go on
    assert capsys.readouterr().err.endswith(
        "ignite-mgpu: stopped by SIGTERM before a restart. --resume auto continues from the last complete checkpoint.\n"
    )


def test_rank_0s_return_value_travels_pickled_with_tensors_on_the_cpu(tmp_path):
    import threading

    import torch

    from ignite_mgpu.processes.attempt_files import RESULT_FILE, read_value, write_result

    write_result(tmp_path / RESULT_FILE, {"loss": 0.5, "weight": torch.ones(2)})
    value = read_value(tmp_path)
    assert value["loss"] == 0.5 and torch.equal(value["weight"], torch.ones(2))
    assert read_value(tmp_path / "nothing") is None  # returned None: no file
    with pytest.raises(TypeError, match=r"the job function returned a lock on rank 0 that cannot be pickled \("):
        write_result(tmp_path / "lock.pkl", threading.Lock())


def test_not_reporting_leaves_the_ending_to_the_caller(no_backoff, capsys):
    failed = Outcome(1, "rank 1 failed with ValueError: boom", details="Traceback ...")
    quiet = Scripted(LaunchPlan(backend="gloo", nproc=2), [(failed, None, 0)])
    quiet.report = False
    assert quiet.run() == 1 and quiet.outcome is failed and quiet.value is None
    assert capsys.readouterr().err == ""


def test_one_ranks_death_restarts_at_once_and_a_second_failure_backs_off(monkeypatch, capsys):
    monkeypatch.setattr(next_start, "BACKOFF", 30.0)
    waited = []
    monkeypatch.setattr(supervisor.time, "sleep", waited.append)
    died = dataclasses.replace(killed(), died=True)  # what an attempt makes of one rank killed by a signal
    once = Scripted(LaunchPlan("gloo", 2, max_restarts=2), [(died, None, 3), (Outcome(0), "ok", 9)])
    assert once.run() == 0 and len(once.started) == 2 and waited == []  # no backoff at all
    assert "restart 1 of 2 (dist.max_restarts) after rank 1 failed, at once (one rank died): running the job " in (
        capsys.readouterr().err
    )
    monkeypatch.setattr(supervisor.time, "monotonic", iter(range(0, 10**6, 10)).__next__)  # 10 s per look
    twice = Scripted(LaunchPlan("gloo", 2, max_restarts=2), [(died, None, 3), (died, None, 3), (Outcome(0), "", 9)])
    assert twice.run() == 0 and len(twice.started) == 3 and waited  # the second restart waits
    assert (
        "restart 2 of 2 (dist.max_restarts) after rank 1 failed, in 30 s: running the job " in capsys.readouterr().err
    )


def test_the_fork_server_preloads_ignite_mgpus_own_job_but_never_a_users_module():
    from ignite_mgpu.processes import forkserver

    default = forkserver.preload_for(Job("ignite_mgpu.train.default_job:training"))
    assert default[:2] == ["ignite_mgpu.processes.forkserver", "torch"]  # its signals ignored before the imports
    assert {"torch._dynamo", "ignite.distributed", "ignite_mgpu.train.default_job"} <= set(default)
    assert forkserver.preload_for(Job(killed)) == [forkserver.__name__, *forkserver.PRELOAD]  # a user's: not imported


class Stopped:
    """An attempt as the supervisor's signal handler sees it: what it was told."""

    starting = False
    procs = ["its workers"]  # started: running

    def __init__(self):
        self.stops, self.kills = [], []

    def stop(self, received, sent):
        self.stops.append((received, sent))

    def kill(self, cut_short=""):
        self.kills.append(cut_short)


def test_timeouts_sigterm_to_the_launcher_and_then_its_group_is_one_stop_request(monkeypatch, capsys):
    """GNU timeout sends SIGTERM to its child, then to the child's process group: the launcher gets it twice
    within microseconds. That is one request (the stop's checkpoint is written); the same signal a second later, or
    another one, is a second request: stop at once."""
    sup = Supervisor(LaunchPlan("gloo", 2), Job(print))
    sup.attempt = attempt = Stopped()
    old = signal.signal(signal.SIGTERM, sup._on_signal)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # as timeout does: the child, then its group
        assert attempt.stops == [(signal.SIGTERM, signal.SIGTERM)] and attempt.kills == []
        later = time.monotonic() + stop.SAME_REQUEST_WITHIN
        monkeypatch.setattr(supervisor.time, "monotonic", lambda: later)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        assert attempt.kills == ["a second signal"]
    finally:
        signal.signal(signal.SIGTERM, old)
    assert capsys.readouterr().err.count("SIGTERM received") == 1


def test_a_one_process_jobs_ctrl_c_repeated_at_once_is_one_request(monkeypatch):
    """The same in a job that runs in this process: SIGINT twice within the window asks once; a later one stops
    at once (KeyboardInterrupt)."""
    from ignite_mgpu.processes.worker import in_process_signals

    stop.reset()
    try:
        with in_process_signals():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.stop_requested() == signal.SIGINT
            later = time.monotonic() + stop.SAME_REQUEST_WITHIN
            monkeypatch.setattr(stop.time, "monotonic", lambda: later)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.reset()
