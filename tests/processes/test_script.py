"""`ignite-mgpu run`, in-process: the command's flags reach the plan, a script runs as ``python SCRIPT`` would
run it, its exit codes mean what they say, and the checks before anything starts. The real jobs (2 processes,
torchrun beside it) are in tests/distributed/test_run_script.py. `python -m pytest tests/processes/test_script.py`."""

import argparse
import atexit
import math
import os
import re
import signal
import sys
import traceback

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.errors import ConfigError, ScriptArgumentsError
from ignite_mgpu.processes import launcher, script
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.attempt_files import failure_record
from ignite_mgpu.processes.machine import Machine
from ignite_mgpu.processes.outcome import Outcome, no_restart_reason, outcome
from ignite_mgpu.processes.plan import decide, make_plan


@pytest.fixture
def captured(monkeypatch):
    calls = []

    def fake_run_job(plan, job, claims=None, restart=None, **kwargs):
        calls.append((plan, job.fn, job.args, {"restart": restart, **kwargs}))
        return Ended(Outcome(0))

    monkeypatch.setattr(launcher, "run_job", fake_run_job)
    return calls


@pytest.fixture
def in_worker(monkeypatch):
    """run_script as a worker runs it, with the test process's argv, path, argparse and exit handlers kept."""
    exit_handlers = []
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: exit_handlers.append(1))
    monkeypatch.setattr(argparse.ArgumentParser, "_print_message", argparse.ArgumentParser._print_message)
    return exit_handlers


def test_the_flags_reach_the_plan_and_everything_after_the_script_is_its_own(captured, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    args = ["run", "--nproc", "2", "--max-restarts", "1", "train.py", "--epochs", "1", "--nproc", "3", "-m"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan, fn, job_args, kwargs = captured[0]
    assert fn is script.run_script and job_args == ("train.py", ["--epochs", "1", "--nproc", "3", "-m"], False)
    assert (plan.nproc, plan.max_restarts, plan.join_group, plan.spawn_one) == (2, 1, False, True)
    assert plan.preempt_signal == signal.SIGUSR1  # SLURM's warning, passed on to the script
    assert kwargs["restart"](1).name == "train.py" and not kwargs["restart"](1).resumes


@pytest.mark.parametrize(
    "flags, wait, share",
    [
        (["--wait"], math.inf, False),  # directly before the script: the flag alone, not "train.py" seconds
        (["--wait", "30"], 30.0, False),
        (["--wait", "1e3"], 1000.0, False),
        (["--share"], None, True),
        ([], None, False),
    ],
)
def test_wait_and_share_reach_the_gpu_claims_as_trains_do(captured, tmp_path, monkeypatch, flags, wait, share):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    asked = []
    monkeypatch.setattr(script, "make_plan", lambda cfg, *a, **k: asked.append(cfg) or make_plan(cfg, *a, **k))
    result = CliRunner().invoke(main, ["run", *flags, "train.py", "--wait", "x"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (asked[0].wait, asked[0].share) == (wait, share)
    assert captured[0][2] == ("train.py", ["--wait", "x"], False)  # the script's own --wait


def test_wait_and_share_together_are_refused_as_train_refuses_them(captured, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    result = CliRunner().invoke(main, ["run", "--share", "--wait", "train.py"])
    assert result.exit_code == 2 and not captured
    assert "--share runs beside the other jobs' claims and --wait waits for them to end" in result.output


@pytest.mark.parametrize("value, number", [("usr2", signal.SIGUSR2), ("SIGUSR2", signal.SIGUSR2), ("none", None)])
def test_the_preemption_signal_is_named_either_way_or_turned_off(captured, tmp_path, monkeypatch, value, number):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    result = CliRunner().invoke(main, ["run", "--preempt-signal", value, "train.py"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert captured[0][0].preempt_signal == number


def test_a_module_is_found_where_python_m_looks(captured, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mytrain.py").write_text("")
    result = CliRunner().invoke(main, ["run", "-m", "mytrain", "--lr", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert captured[0][2] == ("mytrain", ["--lr", "1"], True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "nope.py"], r"nope.py: no such script\. Give the path of a Python file"),
        (["run", "-m", "no_such_module_here"], r"-m no_such_module_here: no module named 'no_such_module_here'"),
        (["run", "--nproc", "0", "x.py"], r"dist.nproc"),
        (["run", "--cpu-binding", "tight", "x.py"], r"Invalid value for '--cpu-binding'"),
        (["run", "--preempt-signal", "TERM", "x.py"], r"'--preempt-signal': 'TERM': name a signal that a process"),
        (["run", "--preempt-signal", "SIGNOPE", "x.py"], r"'--preempt-signal': 'SIGNOPE': name a signal"),
    ],
)
def test_mistakes_exit_2_before_anything_starts(captured, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and not captured
    assert re.search(message, result.output), result.output


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},  # torchrun
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "1"},  # srun with several tasks
    ],
)
def test_under_torchrun_or_srun_it_refuses_to_nest_launchers(captured, tmp_path, monkeypatch, env):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(main, ["run", "--nproc", "2", "train.py"])
    assert result.exit_code == 2 and not captured
    assert "ignite-mgpu run was started by torchrun or srun" in result.output
    assert "Use one launcher: run the script itself under torchrun or srun" in result.output


def test_help_documents_the_environment_the_flags_and_the_refusal():
    text = CliRunner().invoke(main, ["run", "--help"]).output
    flags = ("--nproc", "--gpus", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--cpu-binding")
    for word in (*flags, "--preempt-signal"):
        assert word in text
    assert "--max-restarts" in text and "-m, --module" in text and "SCRIPT [SCRIPT ARGS]..." in text
    assert "TORCHELASTIC_RESTART_COUNT" in " ".join(text.split()) and "init_process_group()" in text
    assert "Refused under torchrun or srun" in " ".join(text.split()) and "Exit codes: 0 success" in text
    assert "run " in CliRunner().invoke(main, ["--help"]).output  # listed among the commands


def test_a_script_chooses_its_backend_so_ours_refuses_nothing_for_it():
    one_gpu = Machine(cuda_devices=1, cpu_count=4)
    plan = decide(DistConfig(nproc=2), None, one_gpu, {}, join_group=False)
    assert plan.nproc == 2 and plan.spawn_one and not plan.join_group
    assert "CUDA_VISIBLE_DEVICES" not in plan.env  # its GPU stays visible: a gloo script may use it
    with pytest.raises(ConfigError, match="NCCL cannot put two ranks on one GPU"):
        decide(DistConfig(nproc=2), None, one_gpu, {})  # the default job's check


def write(tmp_path, text, name="job.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_script_runs_as_main_with_its_arguments_and_its_folder_first_on_the_path(in_worker, tmp_path):
    out = tmp_path / "seen.txt"
    path = write(tmp_path, f"import sys\nopen({str(out)!r}, 'w').write(repr([__name__, sys.argv, sys.path[0]]))\n")
    assert script.run_script(0, path, ["--epochs", "1"], False) is None
    assert out.read_text() == repr(["__main__", [path, "--epochs", "1"], str(tmp_path)])
    assert in_worker == [1]  # its exit handlers ran, as at the end of `python SCRIPT`


def test_a_module_runs_as_python_m_runs_it(in_worker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "import sys\nopen('seen.txt', 'w').write(repr([__name__, sys.argv[1:]]))\n", "mymod.py")
    script.run_script(0, "mymod", ["a"], True)
    assert (tmp_path / "seen.txt").read_text() == repr(["__main__", ["a"]])


@pytest.mark.parametrize(
    "exit_with, error, message",
    [
        ("0", None, None),
        ("None", None, None),
        ("2", ScriptArgumentsError, r"job.py rejected its arguments: it exited with code 2, as argparse and click do"),
        ("5", RuntimeError, r"^job.py exited with code 5 \(sys.exit\)$"),
        ("'out of data'", RuntimeError, r"^job.py exited with the message 'out of data' \(sys.exit\)$"),
    ],
)
def test_what_sys_exit_means_for_the_job(in_worker, tmp_path, exit_with, error, message):
    path = write(tmp_path, f"import sys\nsys.exit({exit_with})\n")
    if error is None:
        assert script.run_script(0, path, [], False) is None
        return
    with pytest.raises(error, match=message) as caught:
        script.run_script(0, path, [], False)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert frames[-1].filename == path and frames[-1].line == f"sys.exit({exit_with})"  # where the script exited


def test_the_scripts_own_error_passes_through_from_its_first_frame(in_worker, tmp_path):
    path = write(tmp_path, "def f():\n    raise ValueError('bad batch')\nf()\n")
    with pytest.raises(ValueError, match="bad batch") as caught:
        script.run_script(0, path, [], False)
    files = [os.path.basename(f.filename) for f in traceback.extract_tb(caught.value.__traceback__)]
    assert files[-2:] == ["job.py", "job.py"] and not any("runpy" in f for f in files), files


def test_only_rank_0_prints_the_usage(in_worker, tmp_path, monkeypatch, capsys):
    path = write(tmp_path, "import argparse\nargparse.ArgumentParser().parse_args()\n")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ScriptArgumentsError):
        script.run_script(1, path, ["--bogus"], False)
    assert capsys.readouterr().err == ""


def test_rank_0_prints_the_usage_once(in_worker, tmp_path, monkeypatch, capsys):
    path = write(tmp_path, "import argparse\nargparse.ArgumentParser(prog='job.py').parse_args()\n")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ScriptArgumentsError):
        script.run_script(0, path, ["--bogus"], False)
    assert "job.py: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_usage_error_ends_the_job_with_2_and_is_not_restarted():
    record = failure_record(0, ScriptArgumentsError("job.py rejected its arguments: ..."))
    assert record["code"] == 2 and record["user_error"] and record["traceback"] == ""
    every = [record, {**record, "rank": 1}]
    assert (outcome(every, [2, 2]).code, outcome(every, [2, 2]).message()) == (2, "job.py rejected its arguments: ...")
    assert outcome([record | {"rank": 1}], [0, 2]).message() == "rank 1: job.py rejected its arguments: ..."
    assert no_restart_reason(every, [2, 2]) == (
        "the script rejected its arguments, and a restart would give it the same ones"
    )
    crashed = failure_record(1, RuntimeError("job.py exited with code 5 (sys.exit)"))
    assert crashed["code"] == 1 and no_restart_reason([crashed], [0, 1], (1, 1)) is None  # a restart may cure it
