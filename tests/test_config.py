"""Config loading: precedence, unknown keys, types and value checks. `python -m pytest tests/test_config.py`."""

import dataclasses

import pytest

from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.loading import dump_config, load_config
from ignite_mgpu.config.schema import Config, DataConfig
from ignite_mgpu.errors import ConfigError


def test_defaults_need_no_file():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.data.name == "synthetic" and cfg.dist.backend == "auto"


def test_precedence_defaults_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 0.2\n  name: adamw\ntrain:\n  epochs: 5\n")
    cfg = load_config(path, ["optim.lr=0.3"])
    assert cfg.optim.lr == 0.3  # override beats the file
    assert cfg.optim.name == "adamw"  # file beats the default
    assert cfg.train.epochs == 5
    assert cfg.optim.weight_decay == Config().optim.weight_decay  # untouched default


def test_dump_round_trips(tmp_path):
    cfg = load_config(overrides=["optim.lr=0.125", "train.clip_grad_norm=1.5", "dist.gpus=2,3"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_dump_writes_what_omegaconf_writes_and_strings_stay_strings(tmp_path):
    from omegaconf import OmegaConf

    cfg = load_config(overrides=["output_dir=/tmp/a b", "train.micro_batch=auto", "optim.lr=1e-4"])
    awkward = {"a": "1e-3", "b": "true", "c": "null", "d": "", "e": "x: y", "f": [1, "2", None], "g": {"h": "yes"}}
    awkward |= {"i": "ünï", "j": "0x10", "k": "inf", "l": "- a", "m": ".5", "n": "~", "o": "#x"}
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, args=awkward))
    assert dump_config(cfg) == OmegaConf.to_yaml(OmegaConf.structured(cfg))
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize(
    "override, match",
    [
        (
            "optim.lrr=0.1",
            r"'optim.lrr' \(from the command line\) is not a key of section optim; did you mean optim.lr=0.1\?",
        ),
        ("epochs=3", r"'epochs' \(from the command line\) is not a top-level key; did you mean train.epochs=3\?"),
        ("train.lr=0.1", r"not a key of section train; did you mean optim.lr=0.1\?"),
        ("optim.xyzzy=1", r"not a key of section optim \(its keys: name, lr, momentum, nesterov, weight_decay,"),
        ("optim.name=torch.optim.Adam", r"'optim.name' = 'torch.optim.Adam' is invalid: use a name \(Adam\) or"),
        ("optim.scheduler=lr.StepLR", r"'optim.scheduler' = 'lr.StepLR' is invalid"),  # what exists: test_cli
        ("optim.scheduler_args.gamma=0.5", r"optim.scheduler_args is for a scheduler class or factory, not .*cosine"),
        (
            "optim.param_groups=mypkg:groups optim.no_decay_norm_and_bias=true",
            r"optim.no_decay_norm_and_bias=true and optim.param_groups both make the groups: choose one",
        ),
        (
            "train.loss=model train.loss_args.weight=[1]",
            r"train.loss_args is for a loss function, but train.loss=model",
        ),
        ("train.epochs=abc", r"train.epochs.*abc"),
        ("train.epochs=0", r"train.epochs.*at least 1"),
        ("data.batch_size=0", r"data.batch_size"),
        ("optim.lr=nan", r"optim.lr.*finite"),
        ("dist.nproc=0", r"dist.nproc.*--nproc"),
        ("dist.backend=mpi", r"dist.backend"),
        ("dist.cpu_binding=socket", r"config key 'dist.cpu_binding' \(from the command line\).*'socket'.*auto"),
        ("data.num_workers=many", r"config key 'data.num_workers' .*'many'.*incompatible"),
        (
            "data.num_workers=-1",
            r"data.num_workers' = -1 is invalid: use 0 \(load in the training process\), more, or auto",
        ),
        ("dist.node_rank=2", r"dist.node_rank.*0..0"),
        ("train.clip_grad_norm=-1", r"train.clip_grad_norm"),
        ("lr", r"'lr' is not of the form key=value"),
        (
            "dist.max_restarts=-1",
            r"^config key 'dist.max_restarts' = -1 is invalid: use 0 \(a failed rank ends the job\) or a number of "
            r"restarts, e.g. --max-restarts 3\.$",
        ),
        (
            "checkpoint.every_minutes=0",
            r"^config key 'checkpoint.every_minutes' = 0.0 is invalid: use null \(no time-based checkpoints\) or a "
            r"number of minutes > 0, e.g. 10\.$",
        ),
        ("checkpoint.every_minutes=nan", r"'checkpoint.every_minutes' = nan is invalid"),
        ("dist.preempt_signal=USR3", r"'dist.preempt_signal' = 'USR3' is invalid: name a signal that a process can"),
        ("dist.preempt_signal=SIGTERM", r"'dist.preempt_signal' = 'SIGTERM' is invalid.*SIGUSR1 or SIGUSR2"),
        ("train.loggers=[mlfow]", r"'train.loggers\[0\]'.*'mlfow', expected one of \['tensorboard', 'mlflow', 'wandb'"),
        ("train.log_every=0", r"'train.log_every' = 0 is invalid: log the training loss every N >= 1 iterations"),
        ("train.logger_args.mlfow.experiment=x", r"'train.logger_args' = 'mlfow' is invalid: the keys are tracker"),
        ("train.logger_args.mlflow=3", r"'train.logger_args.mlflow'.*incompatible"),
    ],
)
def test_bad_values_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=override.split(" "))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["dist.strategy=fsdp", "model.sync_batchnorm=true"],
            r"model.sync_batchnorm=true cannot be combined with --strategy fsdp: ignite-mgpu refuses rather than "
            r"convert.*Use --strategy ddp for SyncBatchNorm, or set model.sync_batchnorm=false",
        ),
        (
            ["model.fsdp_blocks=[BasicBlock]"],
            r"model.fsdp_blocks=\['BasicBlock'\] is an option of --strategy fsdp, but the strategy is ddp.*Add "
            r"--strategy fsdp, or drop the option",
        ),
        (["dist.strategy=dp", "model.fsdp_reshard_after_forward=false"], r"the strategy is dp, which would ignore it"),
        (
            ["dist.strategy=dp", "checkpoint.format=sharded"],
            r"checkpoint.format=sharded with --strategy dp: DataParallel is one process.*Use checkpoint.format=full",
        ),
        (["checkpoint.format=folder"], r"checkpoint.format.*'folder'.*full"),
    ],
)
def test_strategy_options_that_do_not_belong_together(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


def test_fsdp_options_from_the_command_line():
    cfg = load_config(overrides=["dist.strategy=fsdp", "model.fsdp_blocks=[Block,Layer]", "checkpoint.format=sharded"])
    assert cfg.model.fsdp_blocks == ["Block", "Layer"] and cfg.checkpoint.format == "sharded"
    assert load_config(overrides=["checkpoint.format=sharded"]).checkpoint.format == "sharded"  # DDP writes folders too


def test_num_workers_takes_a_count_or_auto():
    assert load_config(overrides=["data.num_workers=auto"]).data.num_workers == "auto"
    assert load_config(overrides=["data.num_workers=3"]).data.num_workers == 3
    with pytest.raises(ConfigError, match="data.num_workers' = 'x' is invalid"):
        validate(Config(data=DataConfig(num_workers="x")))  # built in Python, without OmegaConf's type check


def test_dataset_needing_root():
    with pytest.raises(ConfigError, match="needs data.root"):
        load_config(overrides=["data.name=cifar10"])
    # Whether the folder exists is the pre-flight's (tests/test_preflight.py): loading a config reads no folder.
    assert load_config(overrides=["data.name=cifar10", "data.root=/nonexistent"]).data.root == "/nonexistent"


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trian:\n  epochs: 3\n")
    with pytest.raises(
        ConfigError, match=r"'trian' \(from .*unknown.yaml\) is not a top-level key; did you mean train\?"
    ):
        load_config(unknown)


def test_multinode_needs_port():
    with pytest.raises(ConfigError, match="--master-port"):
        load_config(overrides=["dist.nnodes=2"])


def test_yaml_is_parsed_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("seed: !!python/object/apply:os.system ['touch pwned']\n")
    with pytest.raises(ConfigError):
        load_config(evil)
    assert not (tmp_path / "pwned").exists()


def test_default_yaml_lists_every_key_with_its_default():
    from pathlib import Path

    from omegaconf import OmegaConf

    listed = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "configs" / "default.yaml"))
    assert listed == OmegaConf.to_container(OmegaConf.structured(Config))


def test_max_restarts_are_refused_across_nodes():
    with pytest.raises(ConfigError, match=r"^--max-restarts 2 with --nnodes 2: each node's launcher would restart"):
        load_config(overrides=["dist.max_restarts=2", "dist.nnodes=2", "dist.master_port=29500"])
    cfg = load_config(overrides=["dist.max_restarts=2", "checkpoint.every_minutes=0.5", "dist.preempt_signal=null"])
    assert (cfg.dist.max_restarts, cfg.checkpoint.every_minutes, cfg.dist.preempt_signal) == (2, 0.5, None)


def test_trackers_are_the_loggers_and_the_old_tensorboard_switch():
    from ignite_mgpu.config.schema import trackers_of

    assert trackers_of(load_config().train) == []  # today's configs: no tracker at all
    assert trackers_of(load_config(overrides=["train.tensorboard=true"]).train) == ["tensorboard"]
    both = load_config(overrides=["train.loggers=[mlflow,tensorboard,csv]", "train.tensorboard=true"])
    assert trackers_of(both.train) == ["mlflow", "tensorboard", "csv"]  # each once


@pytest.mark.parametrize("override", ["eval.metrics=[pkg:]", "model.fsdp_blocks=[a:]"])
def test_an_override_yaml_cannot_parse_is_one_paragraph_naming_it(override):
    with pytest.raises(ConfigError, match=r"override '.*': its value is not valid YAML .* Quote a value") as err:
        load_config(overrides=["train.epochs=3", override])
    assert override in str(err.value) and "\n" not in str(err.value)
