"""The pre-flight shared by `ignite-mgpu train` and `ignite_mgpu.fit`: from Python, a bad output folder, resume
target or dataset size is refused with exit code 2 before anything starts, and the folder is locked while the job
runs. The launcher is replaced; the real jobs are in tests/distributed. `python -m pytest tests/test_preflight.py`."""

import re
from pathlib import Path

import pytest
import torch

from ignite_mgpu import fit, jobs, preflight
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.env.clock import JobClock
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.processes import launcher, worker
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.job import Job
from ignite_mgpu.processes.outcome import Outcome
from ignite_mgpu.processes.worker import WorkerSpec
from ignite_mgpu.runs import folder, lock
from ignite_mgpu.train.tracking.packages import check_trackers


@pytest.fixture
def launched(monkeypatch):
    calls = []

    def fake_run_job(plan, job, claims=None, restart=None, **kwargs):
        locked = (Path(job.args[-1].output_dir) / ".lock").exists()
        calls.append((plan, (job.fn, *job.args), locked, {"restart": restart, **kwargs}))
        return Ended(Outcome(0))

    monkeypatch.setattr(launcher, "run_job", fake_run_job)
    return calls


def restart_count(plan, restarts):
    """What the job's workers count after ``restarts`` restarts (TORCHELASTIC_RESTART_COUNT, read by training)."""
    spec = WorkerSpec(plan, Job("unused:fn"), "folder", JobClock(0.0), restarts)
    return int(worker.torchrun_variables(spec, 0)["TORCHELASTIC_RESTART_COUNT"])


def config(tmp_path, *overrides):
    return load_config(overrides=[f"output_dir={tmp_path / 'out'}", *overrides])


def test_fit_runs_the_default_job_under_the_lock(launched, tmp_path):
    assert fit(config(tmp_path, "dist.nproc=2")) == 0
    plan, (target, cfg), locked, _ = launched[0]
    assert target == "ignite_mgpu.train.default_job:training" and plan.world_size == 2 and locked
    assert not (tmp_path / "out" / ".lock").exists()  # released when the job ended


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dist.nproc=3", "data.batch_size=2"], "each needs at least one sample of it"),
        (["resume=nope.pt"], "no such file"),
        (["model.name=resnet181"], "Did you mean 'resnet18'"),
    ],
)
def test_fit_refuses_bad_input_before_anything_starts(launched, tmp_path, capsys, overrides, message):
    assert fit(config(tmp_path, *overrides)) == 2
    err = capsys.readouterr().err
    assert err.startswith("ignite-mgpu: error: ") and message in err and "Traceback" not in err
    assert not launched and not (tmp_path / "out").exists()


def test_fit_validates_a_config_built_by_hand(launched, tmp_path, capsys):
    from ignite_mgpu import Config

    cfg = Config(output_dir=str(tmp_path / "out"))
    cfg.train.epochs = 0  # Config(...) skips load_config's validation; fit does it
    assert fit(cfg) == 2 and "train.epochs" in capsys.readouterr().err and not launched


def test_fit_refuses_another_runs_checkpoints_and_a_corrupt_resume_file(launched, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"model": {}}, out / "checkpoint_10.pt")
    assert fit(config(tmp_path)) == 2 and "already holds checkpoints" in capsys.readouterr().err
    (tmp_path / "half.pt").write_bytes(b"PK\x03\x04 half a zip")
    assert fit(config(tmp_path, f"resume={tmp_path / 'half.pt'}")) == 1  # the data failed, not the command
    assert "corrupt or truncated" in capsys.readouterr().err
    assert not launched and (out / "checkpoint_10.pt").exists()


def written_with(tmp_path, *overrides, world_size=2):
    """A run folder with one checkpoint of a run of ``overrides``, its ``run`` entry as training writes it."""
    from ignite_mgpu.checkpoint.same_run import run_signature

    cfg = config(tmp_path, *overrides)
    run = {"world_size": world_size, "global_batch": cfg.data.batch_size, "config": run_signature(cfg)}
    (tmp_path / "out").mkdir(exist_ok=True)
    torch.save({"model": {"w": torch.zeros(2)}, "run": run}, tmp_path / "out" / "checkpoint_15.pt")


def test_a_resume_of_a_run_with_other_settings_is_refused_before_any_worker_starts(launched, tmp_path, capsys):
    """--resume auto data.batch_size=32 on a run written with 64: exit 2 before anything starts (the workers found
    it, rank 1 failed with CheckpointError, exit 1); with allow_config_change a new global batch is refused too,
    saying why: the checkpoint counts its epoch in batches of 64 (epoch 2 trained 480 of 960 samples)."""
    written_with(tmp_path, "data.batch_size=64")
    assert fit(config(tmp_path, "resume=auto", "data.batch_size=32")) == 2
    err = capsys.readouterr().err
    assert "checkpoint_15.pt belongs to a run with other settings (data.batch_size: 64 -> 32)" in err, err
    assert not launched
    allowed = config(tmp_path, "resume=auto", "data.batch_size=32", "checkpoint.allow_config_change=true")
    assert fit(allowed) == 2
    err = capsys.readouterr().err
    assert re.search(r"checkpoint_15.pt was trained with data.batch_size=64, and this run asks for 32: checkpoint\."
                     r"allow_config_change=true lets other settings change, not the global batch\. .* Resume with "
                     r"data.batch_size=64 \(train.micro_batch splits it", err), err  # fmt: skip
    assert not launched
    assert fit(config(tmp_path, "resume=auto", "data.batch_size=64", "optim.lr=0.1")) == 2  # another setting
    assert "(optim.lr: 0.05 -> 0.1)" in capsys.readouterr().err and not launched
    allowed = config(
        tmp_path, "resume=auto", "data.batch_size=64", "optim.lr=0.1", "checkpoint.allow_config_change=true"
    )
    assert fit(allowed) == 0 and len(launched) == 1  # allowed: the workers resume it


def test_every_mistake_is_shown_at_once_what_the_config_names_before_the_output_folder(launched, tmp_path, capsys):
    """A mistyped dataset factory is not hidden behind the output folder's checkpoints: both, in that order."""
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"model": {}}, out / "checkpoint_10.pt")
    factory = "tests.plugins_pkg.no_such_module:make"
    assert fit(config(tmp_path, f"data.name={factory}", "model.name=resnet181")) == 2
    err = capsys.readouterr().err
    assert err.startswith("ignite-mgpu: error: 3 problems, in the order checked:\n  1. data.name="), err
    assert err.index("data.name=") < err.index("resnet181") < err.index("already holds checkpoints"), err
    assert not launched


def test_every_invalid_value_is_shown_at_once_in_the_files_order():
    with pytest.raises(ConfigError) as raised:
        load_config(overrides=["optim.lr=-1", "data.name=mnsit", "data.batch_size=0", "train.epochs=0"])
    lines = str(raised.value).splitlines()
    assert lines[0] == "4 problems, in the order checked:"
    assert [line.split("'")[1] for line in lines[1:]] == ["data.batch_size", "data.name", "optim.lr", "train.epochs"]
    with pytest.raises(ConfigError, match="^config key 'optim.lr' = -1.0 is invalid"):  # one: as it always was
        load_config(overrides=["optim.lr=-1"])


def test_checkpoints_written_before_the_lock_is_taken_are_refused(launched, tmp_path, monkeypatch, capsys):
    # A job that ran to its end between this job's first check and its lock: checked again under the lock.
    out = tmp_path / "out"
    take_lock = lock._take_lock

    def another_job_ran_meanwhile(lock, output_dir):
        torch.save({"model": {}}, output_dir / "checkpoint_10.pt")
        return take_lock(lock, output_dir)

    monkeypatch.setattr(lock, "_take_lock", another_job_ran_meanwhile)
    assert fit(config(tmp_path)) == 2 and "already holds checkpoints" in capsys.readouterr().err
    assert not launched  # nothing was launched
    assert (out / "checkpoint_10.pt").exists() and not (out / ".lock").exists()


def test_only_the_jobs_first_process_checks_and_locks(launched, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"model": {}}, out / "checkpoint_10.pt")  # would be refused on the leader
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)  # as torchrun starts the second process
    assert not jobs.is_leader(config(tmp_path))
    assert fit(config(tmp_path)) == 0 and launched[0][0].external
    assert not (out / ".lock").exists()


def test_syncbatchnorm_on_the_cpu_is_refused_before_anything_starts(launched, tmp_path, capsys):
    assert fit(config(tmp_path, "model.sync_batchnorm=true", "dist.nproc=2")) == 2
    err = capsys.readouterr().err
    assert "model.sync_batchnorm=true: PyTorch's SyncBatchNorm only works on CUDA GPUs" in err and not launched
    assert fit(config(tmp_path, "model.sync_batchnorm=true")) == 0  # one process: nothing to synchronise


def test_compile_on_the_cpu_without_a_compiler_is_refused(launched, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert fit(config(tmp_path, "model.compile=true")) == 2
    assert "model.compile=true on the CPU needs a C++ compiler" in capsys.readouterr().err and not launched


def test_a_run_without_output_dir_under_torchrun_or_slurm_is_named_by_the_job(monkeypatch, tmp_path, capsys):
    from ignite_mgpu.config.schema import Config

    monkeypatch.chdir(tmp_path)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    given = Config()
    cfg = jobs.resolve_output_dir(given, {**torchrun, "TORCHELASTIC_RUN_ID": "exp7"})
    assert cfg.output_dir == "runs/job-exp7"  # every process and every restart of the job agree
    assert given.output_dir is None  # the caller's config is left as it is
    with pytest.raises(preflight.ConfigError, match="under torchrun without --rdzv-id"):
        jobs.resolve_output_dir(Config(), {**torchrun, "TORCHELASTIC_RUN_ID": "none"})
    slurm = jobs.resolve_output_dir(Config(), {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
    assert slurm.output_dir == "runs/job-4242"
    named = jobs.resolve_output_dir(Config(output_dir="mine"), {})
    assert named.output_dir == "mine"  # a folder the user names is kept as it is
    first_start = jobs.resolve_output_dir(Config(resume="auto"), {})  # no earlier run: a new one, as on a first start
    assert folder.RUN_NAME.fullmatch(first_start.output_dir.removeprefix("runs/"))
    stamped = jobs.resolve_output_dir(Config(), {}, now=0.0)
    assert folder.RUN_NAME.fullmatch(stamped.output_dir.removeprefix("runs/"))


def test_resume_auto_without_a_checkpoint_starts_a_new_run(launched, tmp_path, capsys):
    # The same command works on the first start and on every restart by torchrun, SLURM or Kubernetes; the
    # worker says that it starts a new run (tests/checkpoint/test_resume.py).
    assert fit(config(tmp_path, "resume=auto")) == 0
    plan, (target, cfg), locked, _ = launched[0]
    assert cfg.resume == "auto" and locked and "error" not in capsys.readouterr().err


def test_restarts_without_any_checkpoint_are_allowed_with_a_warning(launched, tmp_path, capsys):
    assert fit(config(tmp_path, "dist.max_restarts=2", "checkpoint.every=0")) == 0
    assert capsys.readouterr().err == (
        "ignite-mgpu: warning: --max-restarts 2 without checkpoints (checkpoint.every=0, checkpoint.every_iters=0, "
        "checkpoint.every_minutes=null): every restart starts the training from the beginning. Set "
        "checkpoint.every_minutes (e.g. 10) or checkpoint.every so that a restart resumes close to where the job "
        "failed.\n"
    )
    assert fit(config(tmp_path, "dist.max_restarts=2", "checkpoint.every=0", "checkpoint.every_minutes=5")) == 0
    assert fit(config(tmp_path, "checkpoint.every=0")) == 0  # no restarts: nothing to warn about
    assert capsys.readouterr().err == ""


def test_a_restart_of_the_default_job_resumes_the_newest_complete_checkpoint(launched, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # the job was requeued twice before
    assert fit(config(tmp_path, "dist.nproc=2", "dist.max_restarts=1")) == 0
    restart = launched[0][3]["restart"]
    first = restart(1)
    assert first.checkpoint is None and first.iteration == 0  # none written yet: from the beginning
    plan, (target, _), _, _ = launched[0]
    ((cfg,), restarts) = first.args, restart_count(plan, 1)
    assert target == "ignite_mgpu.train.default_job:training" and cfg.resume == "auto" and restarts == 3
    out = tmp_path / "out"
    torch.save({"model": {}}, out / "checkpoint_8.pt")
    (out / "checkpoint_12.pt").write_bytes(b"PK\x03\x04 truncated")  # the newest is incomplete: skipped
    second = restart(2)
    assert (second.checkpoint, second.iteration, restart_count(plan, 2)) == (str(out / "checkpoint_8.pt"), 8, 4)


def test_a_dataset_folder_is_checked_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        preflight.check_job(load_config(overrides=["data.name=cifar10", f"data.root={tmp_path}/nope"]))
    with pytest.raises(ConfigError, match=r"root/train/<class>"):
        preflight.check_job(load_config(overrides=["data.name=imagefolder", f"data.root={tmp_path}"]))
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    preflight.check_data_root(load_config(overrides=["data.name=imagefolder", f"data.root={tmp_path}"]))
    assert fit(load_config(overrides=["data.name=cifar10", f"data.root={tmp_path}/nope"])) == 2  # fit checks it too


def test_a_tracker_without_its_package_is_exit_2_before_anything_starts(launched, tmp_path, capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "mlflow" else real_find_spec(name))
    assert fit(config(tmp_path, "train.loggers=[csv,mlflow]")) == 2
    err = capsys.readouterr().err
    assert "train.loggers asks for the mlflow tracker, which needs mlflow, not installed here: " in err
    assert "pip install 'ignite-mgpu[mlflow]' (that is, mlflow-skinny (or mlflow), sqlalchemy and alembic)" in err
    assert not launched and not (tmp_path / "out").exists()
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real_find_spec(name)
    )
    with pytest.raises(
        ConfigError, match=r"train.tensorboard=true asks for the tensorboard tracker.*or set it to false"
    ):
        check_trackers(config(tmp_path, "train.tensorboard=true").train)


def test_tracker_arguments_are_checked_before_anything_starts(tmp_path):
    check_trackers(config(tmp_path, "train.logger_args.mlflow.experiment=x").train)
    with pytest.raises(ConfigError, match=r"train.logger_args.mlflow.experimnet is not an argument of the mlflow"):
        check_trackers(config(tmp_path, "train.logger_args.mlflow.experimnet=x").train)
    with pytest.raises(
        ConfigError, match=r"train.logger_args.csv.path is not an argument of the csv tracker; it takes none"
    ):
        check_trackers(config(tmp_path, "train.logger_args.csv.path=x").train)
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    check_trackers(config(tmp_path, "train.logger_args.wandb.project=p").train)  # wandb.init's keywords
    with pytest.raises(ConfigError, match=r"train.logger_args.wandb.projcet is not an argument of the wandb tracker"):
        check_trackers(config(tmp_path, "train.logger_args.wandb.projcet=p").train)


CHECKS_IN_A_FRESH_PROCESS = """
import sys
from ignite_mgpu import jobs, preflight
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.processes import machine

machine.GPU_DRIVER_FILES = ()  # this machine as one without a GPU driver, whatever the machine running the test has
cfg = load_config(overrides=sys.argv[1:])
from ignite_mgpu.train.tracking.packages import check_trackers

preflight.check_job(cfg)
check_trackers(cfg.train)
cfg = jobs.resolve_output_dir(cfg)
preflight.check_output_dir(cfg)
with jobs.checked_plan(cfg):
    pass
print("torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "overrides, imports_torch",
    [
        ([], False),  # the default job: built-in model, optimizer, schedule, loss and generated data
        (["optim.name=Adam", "model.name=mlp", "train.loss_args.label_smoothing=0.1"], True),  # a torch class
    ],
)
def test_the_launcher_imports_torch_only_for_what_needs_it(tmp_path, overrides, imports_torch):
    # Importing torch takes about 3 s on a small machine, and the workers import it again: the launcher of the
    # default job checks everything without it (a torch class, a factory or a dataset to read still import it).
    import subprocess
    import sys

    argv = [f"output_dir={tmp_path / 'out'}", "dist.nproc=2", "dist.backend=gloo", *overrides]
    done = subprocess.run([sys.executable, "-c", CHECKS_IN_A_FRESH_PROCESS, *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(imports_torch)]


def test_a_python_caller_is_told_config_keys_the_command_line_its_flags(launched, tmp_path, capsys):
    """fit() from Python: the refusal names resume=auto and output_dir, not the flags of a command it did not run."""
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"model": {}}, out / "checkpoint_10.pt")
    assert fit(config(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "Continue it with resume=auto, or choose a new output_dir; nothing was deleted." in err
    assert "--" not in err  # no flag of a command that was not run
    from click.testing import CliRunner

    from ignite_mgpu.cli.commands import main

    cli = CliRunner().invoke(main, ["train", "--output-dir", str(out)])
    assert cli.exit_code == 2 and "Continue it with --resume auto, or choose a new --output-dir" in cli.output
    capsys.readouterr()
    assert fit(config(tmp_path)) == 2 and "with resume=auto" in capsys.readouterr().err  # Python again, after it


def test_flags_become_the_keys_they_set():
    from ignite_mgpu.config.loading import dotted_keys
    from ignite_mgpu.text import as_settings

    said = as_settings(
        "--gpus 2,3 requested; --resume runs/a/checkpoint_4.pt: pass --output-dir to choose one, or --wait.",
        dotted_keys(),
    )
    assert (
        said == "dist.gpus=2,3 requested; resume=runs/a/checkpoint_4.pt: pass output_dir to choose one, or dist.wait."
    )
