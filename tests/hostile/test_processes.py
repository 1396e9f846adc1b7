"""More processes than the machine can start: fork's EAGAIN (the per-user process limit, or memory) and the fork
server that died of it end in one paragraph, never a raw BlockingIOError then "Aborted!", and no restart.
`python -m pytest tests/hostile`."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from ignite_mgpu.env.clock import JobClock
from ignite_mgpu.processes.attempt import Attempt
from ignite_mgpu.processes.job import Job
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.processes.supervisor import Supervisor
from ignite_mgpu.processes.worker import WorkerSpec


@pytest.fixture
def refused(monkeypatch):
    """Every attempt's first worker starts (a sleeper); the machine refuses the second with the error set in
    ``refused.err``. ``refused.calls``: the starts asked for; ``refused.attempts``: the attempts."""

    class Starts:
        err: BaseException = OSError()
        calls = 0
        attempts: list[Attempt] = []

    def start_worker(attempt, local_rank):
        Starts.calls += 1
        if attempt not in Starts.attempts:
            Starts.attempts.append(attempt)
        if local_rank == 1:
            raise Starts.err
        p = mp.get_context("fork").Process(target=time.sleep, args=(60,))
        p.start()
        return p

    monkeypatch.setattr(Attempt, "start_worker", start_worker)
    return Starts


@pytest.mark.parametrize("err", [BlockingIOError(11, "Resource temporarily unavailable"), EOFError()])
def test_a_refused_process_is_one_paragraph_exit_2_without_restart(capsys, refused, err):
    refused.err = err
    sup = Supervisor(LaunchPlan("gloo", 4, max_restarts=2), Job(print))
    start = time.monotonic()
    assert sup.run() == 2
    assert time.monotonic() - start < 20 and refused.calls == 2  # no third start, no restart
    assert refused.attempts[0].procs[0].exitcode is not None  # the started one was stopped
    out = " ".join(capsys.readouterr().err.split())
    assert "could not start process 2 of 4: this machine refused a new process" in out
    assert "ulimit -u" in out and "Lower --nproc" in out and "Traceback" not in out and "restart" not in out


def test_another_os_error_at_a_start_is_not_called_a_refused_process(tmp_path, refused):
    refused.err = OSError(28, "No space left on device")
    attempt = Attempt(WorkerSpec(LaunchPlan("gloo", 2), Job(print), str(tmp_path), JobClock(0.0)), 0)
    with pytest.raises(OSError, match="No space left"):
        attempt._start_all()
    for p in attempt.procs:
        p.kill()
        p.join()


def test_the_fork_server_dies_of_a_refused_fork_without_a_traceback(capsys):
    import os

    from ignite_mgpu.processes.forkserver import quiet_refused_fork

    def raised(err):
        try:
            raise err
        except BaseException as caught:
            return type(caught), caught, caught.__traceback__

    hook = quiet_refused_fork(os.getpid())
    hook(*raised(BlockingIOError(11, "Resource temporarily unavailable")))
    assert capsys.readouterr().err == ""  # the launcher's paragraph says it
    hook(*raised(ValueError("a bug")))
    assert "ValueError: a bug" in capsys.readouterr().err
    quiet_refused_fork(os.getpid() + 1)(*raised(BlockingIOError(11, "in a worker")))
    assert "in a worker" in capsys.readouterr().err  # a forked worker's own error is printed
