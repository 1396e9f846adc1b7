"""Running a decided plan: the requeue after a pre-emption stop. The spawned jobs are in tests/distributed and
tests/faults. `python -m pytest tests/processes/test_launcher.py`."""

from ignite_mgpu.processes import cluster, launcher
from ignite_mgpu.processes.plan import LaunchPlan


def test_a_preempted_job_requeues_once_from_global_rank_0(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cluster, "requeue", lambda: calls.append(1) or "requeued SLURM job 7")
    monkeypatch.setattr(launcher, "_run_here", lambda plan, fn, args: 138)
    plan = LaunchPlan(backend="gloo", nproc=1, external=True, preempt_signal=10)
    monkeypatch.setenv("RANK", "1")
    assert launcher.run_plan(plan, print) == 138 and not calls  # not rank 0
    monkeypatch.setenv("RANK", "0")
    assert launcher.run_plan(plan, print) == 138 and calls == [1]
    assert "ignite-mgpu: requeued SLURM job 7" in capsys.readouterr().err
    monkeypatch.setattr(launcher, "_run_here", lambda plan, fn, args: 143)  # SIGTERM: the user stopped it
    assert launcher.run_plan(plan, print) == 143 and calls == [1]
