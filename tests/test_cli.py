"""The CLI in-process (click's CliRunner) with the launcher replaced: flags map onto the Config it receives,
bad input exits 2 with one paragraph before anything starts. `python -m pytest tests/test_cli.py`."""

import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.parallel import fsdp
from ignite_mgpu.processes import launcher
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.outcome import Outcome


@pytest.fixture
def captured(monkeypatch):
    calls = []

    def fake_run_job(plan, job, *args, **kwargs):
        calls.append((plan, job.fn, (job.fn, *job.args)))
        return Ended(Outcome(0))

    monkeypatch.setattr(launcher, "run_job", fake_run_job)
    return calls


def invoke(args, cwd):
    """Run the CLI in-process with ``cwd`` as the working directory (relative output dirs land there)."""
    before = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(main, args, catch_exceptions=False)
    finally:
        os.chdir(before)


def test_flags_and_overrides_reach_the_config(captured, tmp_path):
    result = invoke(
        [
            "train",
            "--nproc",
            "2",
            "--backend",
            "gloo",
            "optim.lr=0.01",
            "train.epochs=3",
            "--output-dir",
            "out",
            "--timeout",
            "20",
            "--seed",
            "7",
        ],
        tmp_path,
    )
    assert result.exit_code == 0, result.output
    plan, fn, (target, cfg) = captured[0]
    assert fn == target == "ignite_mgpu.train.default_job:training"  # named: the parent never imports it
    assert (plan.nproc, plan.backend, plan.world_size) == (2, "gloo", 2)
    assert cfg.optim.lr == 0.01 and cfg.train.epochs == 3 and cfg.seed == 7
    assert cfg.dist.nproc == 2 and cfg.dist.timeout == 20 and cfg.output_dir == "out"
    assert plan.master_port is None  # the supervisor picks a private file store


def test_yaml_as_first_argument_then_overrides_then_flags(captured, tmp_path):
    (tmp_path / "run.yaml").write_text("optim:\n  lr: 0.2\ndist:\n  nproc: 3\n")
    result = invoke(["train", str(tmp_path / "run.yaml"), "optim.lr=0.3", "dist.nproc=1", "--nproc", "2"], tmp_path)
    assert result.exit_code == 0, result.output
    cfg = captured[0][2][1]
    assert cfg.optim.lr == 0.3 and cfg.dist.nproc == 2


def test_cpu_binding_flag_reaches_the_plan(captured, tmp_path):
    result = invoke(["train", "--cpu-binding", "cores", "--nproc", "1"], tmp_path)
    assert result.exit_code == 0, result.output
    plan, _, (_, cfg) = captured[0]
    assert cfg.dist.cpu_binding == "cores" and plan.binding.mode == "cores"
    assert plan.binding.ranks[0].cpus == tuple(sorted(os.sched_getaffinity(0)))


def test_one_process_runs_in_process_without_group(captured, tmp_path):
    assert invoke(["train"], tmp_path).exit_code == 0
    plan = captured[0][0]
    assert plan.nproc == 1 and plan.backend is None  # CPU default: 1 process, no process group


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--nproc", "0"], "dist.nproc"),
        (
            ["train", "optim.lrr=1"],
            "'optim.lrr' (from the command line) is not a key of section optim; did you mean optim.lr=1?",
        ),
        (
            ["train", "epochs=3"],
            "'epochs' (from the command line) is not a top-level key; did you mean train.epochs=3?",
        ),
        (
            ["train", "--epochs", "3"],
            "no such option: --epochs. Config keys are set as key=value after the command: "
            "did you mean train.epochs=3?",
        ),
        (
            ["train", "--lr", "0.1"],
            "no such option: --lr. Config keys are set as key=value after the command: did you mean optim.lr=0.1?",
        ),
        (["train", "--batch-size=64"], "did you mean data.batch_size=64?"),
        (["train", "--gpu", "2,3"], "no such option: --gpu; did you mean --gpus?"),
        (["train", "model.name=resnet181"], "Did you mean 'resnet18'"),
        (["train", "--backend", "nccl"], "nccl needs CUDA"),
        (["train", "--strategy", "dp"], "needs GPUs"),
        (["train", "--nproc", "3", "data.batch_size=2"], "each needs at least one sample of it"),
        (["train", "--nproc", "2", "data.train_size=8", "data.batch_size=64"], "only has 4 training samples"),
        (["train", "--gpus", "2,3"], "no NVIDIA GPU"),
        (["train", "--gpus", "two"], "--gpus"),
        (["train", "--resume", "nope.pt"], "no such file"),
        (["train", "--max-restarts", "-1"], "config key 'dist.max_restarts' = -1 is invalid: use 0 (a failed rank"),
        (["train", "checkpoint.every_minutes=-5"], "'checkpoint.every_minutes' = -5.0 is invalid: use null (no time"),
        (["train", "dist.preempt_signal=SIGKILL"], "'dist.preempt_signal' = 'SIGKILL' is invalid: name a signal"),
        (["train", "--max-restarts", "1", "--nnodes", "2", "--master-port", "29999"], "--max-restarts 1 with --nnod"),
        (["train", "--fast"], "no such option: --fast"),
        (["train", "data.name=imagefolder", "data.root=/nope"], "does not exist"),
        (["train", "--cpu-binding", "numa"], "numa binds each rank to the CPUs of its GPU's NUMA node, but this job"),
        (["train", "--cpu-binding", "cores", "--nproc", "64", "data.batch_size=128"], "need a CPU each"),
        (["train", "--cpu-binding", "socket"], "'socket' is not one of 'auto', 'none', 'cores', 'numa'"),
        (["train", "--strategy", "fsdp", "model.sync_batchnorm=true"], "cannot be combined with --strategy fsdp"),
        (["train", "model.fsdp_cpu_offload=true"], "model.fsdp_cpu_offload=True is an option of --strategy fsdp"),
        (
            ["train", "--strategy", "fsdp", "--nproc", "2", "model.fsdp_cpu_offload=true"],
            "model.fsdp_cpu_offload=true keeps FSDP's sharded parameters, gradients and optimizer state in CPU memory "
            "between their uses on a GPU, and this job trains on the CPU",
        ),
        (
            ["train", "--strategy", "fsdp", "--nproc", "2", "model.name=resnet18", "model.fsdp_blocks=[Blok]"],
            "model.fsdp_blocks names Blok, but model.name=resnet18 contains no module of that class (its classes with "
            "parameters: BasicBlock, BatchNorm2d, Conv2d, Linear, ResNet, Sequential)",
        ),
        (["train", "--strategy", "dp", "checkpoint.format=sharded"], "checkpoint.format=sharded with --strategy dp"),
    ],
)
def test_bad_input_exits_2_before_spawning(captured, tmp_path, args, message):
    result = invoke(args + ["--output-dir", "out"], tmp_path)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not captured  # nothing was launched
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "3", "data.batch_size=2"], "each needs at least one sample of it"),
        (["--nproc", "2", "data.train_size=8", "data.batch_size=64"], "only has 4 training samples"),
        (["train.loss=nope_pkg.losses:make"], "train.loss=nope_pkg.losses:make"),
        (["--epochs", "1"], "did you mean train.epochs=1?"),
        (["--strategy", "fsdp", "--nproc", "2", "model.fsdp_cpu_offload=true"], "this job trains on the CPU"),
    ],
)
def test_evaluate_makes_the_checks_of_train_before_anything(captured, tmp_path, args, message):
    weights = tmp_path / "weights.pt"
    torch.save({"not": "read"}, weights)  # the checks come first: it would be refused as not a state_dict
    result = invoke(["evaluate", "--checkpoint", str(weights), *args], tmp_path)
    assert result.exit_code == 2, result.output
    assert message in result.output and "not a state_dict" not in result.output
    assert not captured


def test_fsdp_on_one_process_is_allowed_with_a_note(captured, tmp_path, monkeypatch):
    monkeypatch.setattr(fsdp, "runs_on_cpu", lambda: True)  # nothing runs here; PyTorch before 2.6: the next test
    result = invoke(["train", "--strategy", "fsdp", "model.fsdp_blocks=[Conv2d]", "--output-dir", "out"], tmp_path)
    assert result.exit_code == 0, result.output
    plan, _, (_, cfg) = captured[0]
    assert cfg.dist.strategy == "fsdp" and plan.nproc == 1
    assert any("--strategy fsdp with one process: nothing to shard" in m for m in plan.messages)
    assert invoke(["train", "--strategy", "fsdp", "--nproc", "2", "--output-dir", "two"], tmp_path).exit_code == 0
    assert not any("nothing to shard" in m for m in captured[1][0].messages)


def test_fsdp_over_the_cpu_is_refused_where_pytorch_runs_it_only_on_cuda(captured, tmp_path, monkeypatch):
    monkeypatch.setattr(fsdp, "runs_on_cpu", lambda: False)  # PyTorch 2.4 and 2.5
    result = invoke(["train", "--strategy", "fsdp", "--nproc", "2", "--output-dir", "out"], tmp_path)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (
        "strategy=fsdp with 2 processes on the CPU needs PyTorch 2.6 or newer: FSDP2 in PyTorch "
        f"{torch.__version__} runs only on CUDA GPUs (its streams are CUDA's). Upgrade torch (pip install -U "
        "'torch>=2.6'), train on GPUs, or use strategy=ddp." in " ".join(result.output.split())
    )
    assert not captured and not (tmp_path / "out").exists()
    assert invoke(["train", "--strategy", "fsdp", "--output-dir", "one"], tmp_path).exit_code == 0  # one: no shards


def test_a_sharded_folder_is_resumed_or_refused_with_the_fix(captured, tmp_path):
    folder = tmp_path / "out" / "checkpoint_8"
    folder.mkdir(parents=True)  # no .metadata: its writer was stopped
    result = invoke(["train", "--output-dir", "out", "--resume", str(folder)], tmp_path)
    assert result.exit_code == 1 and "the folder is not a complete sharded checkpoint (no .metadata" in result.output
    weights = invoke(["evaluate", "--checkpoint", str(folder)], tmp_path)
    assert weights.exit_code == 2 and "is a sharded checkpoint folder (checkpoint.format=sharded" in weights.output
    assert f"ignite-mgpu checkpoint convert {folder} model.pt" in weights.output.replace("\n", " ")
    assert not captured


def test_click_type_errors_exit_2(tmp_path):
    result = invoke(["train", "--nproc", "abc"], tmp_path)
    assert result.exit_code == 2 and "'abc' is not a valid integer" in result.output


def test_existing_checkpoints_need_resume(captured, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"model": {}}, out / "checkpoint_10.pt")
    result = invoke(["train", "--output-dir", str(out)], tmp_path)
    assert result.exit_code == 2 and "already holds checkpoints" in result.output
    assert (out / "checkpoint_10.pt").exists()


def test_second_job_on_a_locked_output_dir(captured, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    hold = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, f'pid {os.getpid()} on host h'.encode()); "
        "print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        result = invoke(["train", "--output-dir", str(out)], tmp_path)
        assert result.exit_code == 2 and f"locked by pid {holder.pid} on host h" in result.output
    finally:
        holder.kill()
        holder.wait()
    assert (out / ".lock").read_text() == f"pid {holder.pid} on host h"  # left by the killed job: locks nothing
    assert invoke(["train", "--output-dir", str(out)], tmp_path).exit_code == 0
    assert not (out / ".lock").exists()


def test_a_file_system_without_flock_warns_and_runs(captured, tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    result = invoke(["train", "--output-dir", str(tmp_path / "out")], tmp_path)
    assert result.exit_code == 0, result.output
    assert "cannot lock" in result.output and "would not be refused" in result.output
    assert len(captured) == 1  # the job ran


def test_help_is_fast_and_lists_commands():
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ignite_mgpu", "--help"], capture_output=True, text=True, check=True)
    assert time.monotonic() - start < 5  # the real bound (0.3 s) is measured by benchmarks/, not asserted here
    for command in ("train", "evaluate", "devices", "checkpoint", "report"):
        assert command in out.stdout
    check = "import sys, ignite_mgpu.cli.commands; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0  # torch is imported lazily


def test_train_help_documents_every_flag():
    out = CliRunner().invoke(main, ["train", "--help"]).output
    for flag in (
        "--nproc",
        "--backend",
        "--gpus",
        "--strategy",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--timeout",
        "--cpu-binding",
        "--config",
        "--output-dir",
        "--resume",
        "--seed",
    ):
        assert flag in out


def test_devices_without_gpu():
    result = CliRunner().invoke(main, ["devices"])
    assert result.exit_code == 0 and "No NVIDIA GPU found" in result.output and "gloo" in result.output


def test_evaluation_places_the_model_like_training(tmp_path, monkeypatch, capsys):
    # One process: the model is only moved to the device, never wrapped by idist.auto_model (which would pick
    # DataParallel on a machine with several GPUs).
    from ignite_mgpu.config.loading import load_config
    from ignite_mgpu.train import default_job
    from ignite_mgpu.train.models import create_model

    cfg = load_config(None, ["data.val_size=32", "train.keep_cpu_memory=false", f"output_dir={tmp_path}"])
    torch.save(create_model(cfg.model, torch.zeros(1, 3, 32, 32)).state_dict(), tmp_path / "weights.pt")
    monkeypatch.setattr(default_job, "setup_logging", lambda rank: None)  # leave pytest's logging alone
    monkeypatch.setattr(
        default_job.idist, "auto_model", lambda *a, **k: pytest.fail("evaluation used idist.auto_model")
    )
    default_job.scoring(0, cfg, str(tmp_path / "weights.pt"), True)
    assert '"samples": 32' in capsys.readouterr().out


PKG = "tests.plugins_pkg.factories"


@pytest.mark.parametrize(
    "args, message",
    [
        ([f"data.name={PKG}.missing:build"], f"cannot import module '{PKG}.missing'"),
        ([f"data.name={PKG}:nothing"], f"module '{PKG}' has no attribute 'nothing'"),
        ([f"data.name={PKG}:NOT_CALLABLE"], "is a int, not a function or class that can be called"),
        ([f"data.name={PKG}:wrong_return"], "returned list; a dataset factory returns (train, val)"),
        ([f"data.name={PKG}:pairs", "data.args.shards=3"], "data.args gives shards, which"),
        ([f"data.name={PKG}:dicts", "data.args.labels=false"], "train.loss=cross_entropy needs the targets"),
        (
            [f"data.name={PKG}:pairs", "train.loss=model", "checkpoint.metric=accuracy"],
            "checkpoint.metric=accuracy needs",
        ),
        ([f"model.name={PKG}:net", "model.args.width=3"], "model.args gives width, which"),
        (["train.loss=tests.plugins_pkg.nothing:loss"], "train.loss=tests.plugins_pkg.nothing:loss: cannot import"),
        ([f"data.name={PKG}:pairs", "train.loss=model", "eval.metrics=[top5]"], "eval.metrics entry top5 reads class"),
        (["checkpoint.metric=top5"], "checkpoint.metric=top5 is not among the validation metrics (loss, accuracy)"),
        (["eval.metrics=[a.b:mine]", "checkpoint.metric=mine"], "which way it is better is not known: set"),
        ([f"eval.metrics=[{PKG}.missing:m]"], f"eval.metrics={PKG}.missing:m: cannot import module"),
        ([f"eval.metrics=[{PKG}:samples]", "eval.metric_args.samples.scael=2"], "eval.metric_args.samples gives"),
        (
            [f"data.name={PKG}:dicts", "data.args.labels=false", "train.loss=model", "eval.metrics=[perplexity]"],
            "eval.metrics entry perplexity with train.loss=model weights each batch's loss by its tokens",
        ),
    ],
)
def test_plugin_mistakes_exit_2_before_anything_starts(captured, tmp_path, args, message):
    result = invoke(["train", *args, "data.batch_size=8", "--output-dir", "out"], tmp_path)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not captured and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["optim.name=adma"], "ignite-mgpu: error: optim.name=adma is not known. Did you mean Adamax, Adam or RAdam?"),
        (["optim.scheduler=OneCycle"], "optim.scheduler=OneCycle is not known. Did you mean OneCycleLR?"),
        (["optim.scheduler=ReduceLROnPlateau"], "optim.scheduler=ReduceLROnPlateau is not supported"),
        (["optim.name=Adam", "optim.args.beta=0.9"], "optim.args gives beta, which optim.name=Adam does not accept"),
        (["train.loss_args.reduction=sum"], "train.loss_args gives reduction, which train.loss=cross_entropy does not"),
    ],
)
def test_optimizer_schedule_and_loss_mistakes_exit_2_before_anything_starts(captured, tmp_path, args, message):
    result = invoke(["train", *args, "--output-dir", "out"], tmp_path)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1  # one paragraph
    assert not captured and not (tmp_path / "out").exists()


def test_a_warm_up_before_one_cycle_is_allowed_with_a_warning(captured, tmp_path):
    result = invoke(["train", "optim.scheduler=OneCycleLR", "--output-dir", "out"], tmp_path)
    assert result.exit_code == 0 and len(captured) == 1
    assert "warning: optim.warmup_epochs=0.2 before optim.scheduler=OneCycleLR, which warms up itself" in result.output
    quiet = invoke(["train", "optim.scheduler=OneCycleLR", "optim.warmup_epochs=0", "--output-dir", "out2"], tmp_path)
    assert quiet.exit_code == 0 and "warms up itself" not in quiet.output


def test_an_exception_in_the_users_factory_shows_their_traceback_once(captured, tmp_path):
    result = invoke(["train", f"data.name={PKG}:raises", "--output-dir", "out"], tmp_path)
    assert result.exit_code == 2 and not captured
    assert result.output.count("Traceback (most recent call last):") == 1
    assert (
        "in _helper_that_fails" in result.output and "ignite_mgpu" not in result.output.split("ignite-mgpu: error")[0]
    )
    assert result.output.rstrip().endswith("raised ValueError: cannot open shard 40.")


def test_each_run_without_an_output_dir_gets_a_new_folder_and_resume_auto_continues_the_newest(captured, tmp_path):
    first = invoke(["train"], tmp_path)
    second = invoke(["train"], tmp_path)
    assert first.exit_code == second.exit_code == 0
    dirs = [c[2][1].output_dir for c in captured]
    assert dirs[0] != dirs[1] and all(d.startswith("runs/") for d in dirs)
    assert f"output_dir {dirs[0]} (--output-dir chooses one)" in first.output
    (tmp_path / dirs[1]).mkdir(parents=True, exist_ok=True)  # the lock made it
    torch.save({"model": {}}, tmp_path / dirs[1] / "checkpoint_8.pt")  # the newest run was interrupted
    resumed = invoke(["train", "--resume", "auto"], tmp_path)
    assert resumed.exit_code == 0, resumed.output
    assert captured[-1][2][1].output_dir == dirs[1] and len(captured) == 3
    # A job refused once its processes are planned never names a folder it will not make.
    refused = invoke(["train", "--nproc", "3", "data.batch_size=2"], tmp_path)
    assert refused.exit_code == 2 and "each needs at least one sample" in refused.output
    assert "output_dir" not in refused.output and len(captured) == 3


def test_max_restarts_and_resume_auto_on_a_first_start(captured, tmp_path):
    # The requeue-safe command: --resume auto with no checkpoint yet starts a new run (the worker says so).
    result = invoke(["train", "--max-restarts", "2", "--resume", "auto", "--output-dir", "out"], tmp_path)
    assert result.exit_code == 0, result.output
    plan, fn, (target, cfg) = captured[0]
    assert cfg.dist.max_restarts == 2 and plan.max_restarts == 2 and cfg.resume == "auto"
    assert "--max-restarts" in invoke(["train", "--help"], tmp_path).output
