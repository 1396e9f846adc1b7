"""Running a decided plan: the requeue after a pre-emption stop; what launch() returns and raises for a job run
in this process, a function given by name included. The spawned jobs are in tests/distributed and tests/faults.
`python -m pytest tests/processes/test_launcher.py`."""

import pytest

from ignite_mgpu.env import cluster
from ignite_mgpu.errors import ConfigError, JobFailed
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.processes import launcher, notebook
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.job import Job
from ignite_mgpu.processes.outcome import Outcome
from ignite_mgpu.processes.plan import LaunchPlan


def test_a_preempted_job_requeues_once_from_global_rank_0(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cluster, "requeue", lambda script: calls.append(script) or "requeued SLURM job 7")
    monkeypatch.setattr(launcher, "_in_this_process", lambda plan, job, report: Ended(Outcome(138)))
    plan, job = LaunchPlan(backend="gloo", nproc=1, external=True, preempt_signal=10), Job(print)
    monkeypatch.setenv("RANK", "1")
    assert launcher.run_job(plan, job).outcome.code == 138 and not calls  # not rank 0
    monkeypatch.setenv("RANK", "0")
    assert launcher.run_job(plan, job).outcome.code == 138 and calls == [False]  # the default job's wording
    assert "ignite-mgpu: requeued SLURM job 7" in capsys.readouterr().err
    # SIGTERM: the user stopped it
    monkeypatch.setattr(launcher, "_in_this_process", lambda plan, job, report: Ended(Outcome(143)))
    assert launcher.run_job(plan, job).outcome.code == 143 and calls == [False]


def answer(local_rank, base):
    return {"local_rank": local_rank, "answer": base + 1}


def refuse(local_rank):
    raise ConfigError("data.root=/nope: no such folder.")


def test_launch_returns_what_the_function_returned():
    assert launcher.launch(answer, 41) == {"local_rank": 0, "answer": 42}  # one process: run here
    assert launcher.launch(print) is None


def test_a_failed_job_exits_from_a_script_and_raises_in_a_notebook(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        launcher.launch(refuse)
    assert exited.value.code == 1
    assert capsys.readouterr().err == "ignite-mgpu: ConfigError: data.root=/nope: no such folder.\n"
    monkeypatch.setattr(notebook, "interactive", lambda: True)
    with pytest.raises(JobFailed, match=r"^ConfigError: data.root=/nope: no such folder\.$") as raised:
        launcher.launch(refuse)
    assert (raised.value.exit_code, raised.value.rank) == (1, 0) and isinstance(raised.value, RuntimeError)
    assert capsys.readouterr().err == ""  # said once, by the exception


def test_the_gpus_a_job_chose_are_the_workers_and_this_process_gets_its_own_back(monkeypatch):
    import os

    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    def plan_on_gpus(cfg):
        os.environ.update(CUDA_VISIBLE_DEVICES="2,3", CUDA_DEVICE_ORDER="PCI_BUS_ID")  # as make_plan exports them
        return LaunchPlan(backend="nccl", nproc=2, gpus=[2, 3], device="cuda"), GpuClaims()

    seen = []
    monkeypatch.setattr(launcher, "make_plan", plan_on_gpus)
    monkeypatch.setattr(
        launcher,
        "run_job",
        lambda *a, **k: seen.append(os.environ["CUDA_VISIBLE_DEVICES"]) or Ended(Outcome(0), value=7),
    )
    assert launcher.launch(answer, 1, gpus="2,3") == 7 and seen == ["2,3"]  # the workers start with them
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and "CUDA_DEVICE_ORDER" not in os.environ  # a notebook can go on


def test_a_function_named_for_the_workers_must_name_an_importable_module():
    for name in ("tests.processes.test_launcher", "no_such_module_here:run", "tests.processes.test_launcher:"):
        with pytest.raises(ConfigError, match=r"is written 'package.module:function', and its module must be"):
            launcher.launch(name)
    assert launcher.launch("tests.processes.test_launcher:answer", 41) == {"local_rank": 0, "answer": 42}
