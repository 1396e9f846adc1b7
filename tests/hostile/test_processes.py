"""More processes than the machine can start: fork's EAGAIN (the per-user process limit, or memory) and the fork
server that died of it end in one paragraph, never a raw BlockingIOError then "Aborted!", and no restart.
`python -m pytest tests/hostile`."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.processes.supervisor import Supervisor


class Refused(Supervisor):
    """The first worker starts (a sleeper); the machine refuses the second."""

    def __init__(self, plan, err):
        super().__init__(plan, print, ())
        self.err, self.calls = err, 0

    def _start(self, plan, local_rank, args, folder, attempt):
        self.calls += 1
        if local_rank == 1:
            raise self.err
        p = mp.get_context("fork").Process(target=time.sleep, args=(60,))
        p.start()
        return p


@pytest.mark.parametrize("err", [BlockingIOError(11, "Resource temporarily unavailable"), EOFError()])
def test_a_refused_process_is_one_paragraph_exit_2_without_restart(capsys, err):
    sup = Refused(LaunchPlan("gloo", 4, max_restarts=2), err)
    start = time.monotonic()
    assert sup.run() == 2
    assert time.monotonic() - start < 20 and sup.calls == 2  # no third start, no restart
    assert sup.procs[0].exitcode is not None  # the started one was stopped
    out = " ".join(capsys.readouterr().err.split())
    assert "could not start process 2 of 4: this machine refused a new process" in out
    assert "ulimit -u" in out and "Lower --nproc" in out and "Traceback" not in out and "restart" not in out


def test_another_os_error_at_a_start_is_not_called_a_refused_process():
    sup = Refused(LaunchPlan("gloo", 2), OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        sup._start_all(sup.plan, (), "unused", 0)
    for p in sup.procs:
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
