"""The user's model, loss and optimizer factories are checked before any worker starts, as documented: the model
built on the meta device, the loss and optimizer factories called on it, their types checked; one that raises shows
its traceback once and exits 2; a model that cannot be built on the meta device is said so and left to the workers.
`python -m pytest tests/hostile`."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.processes import launcher
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.outcome import Outcome

PKG = "tests.plugins_pkg.meta_factories"
SMALL = ["--nproc", "2", "--backend", "gloo", "data.train_size=64", "data.val_size=16", "data.batch_size=16"]


@pytest.fixture
def started(monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "run_job", lambda *args, **kwargs: calls.append(args) or Ended(Outcome(0)))
    return calls


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (f"model.name={PKG}:model_raises", "model.name=tests.plugins_pkg.meta_factories:model_raises: calling it "
         "raised RuntimeError: the model factory broke."),
        (f"model.name={PKG}:model_wrong", "returned a str; a model factory returns an nn.Module."),
        (f"train.loss={PKG}:loss_raises", "raised ValueError: the loss factory broke."),
        (f"optim.name={PKG}:optimizer_raises", "raised TypeError: the optimizer factory broke."),
        (f"optim.name={PKG}:optimizer_wrong", "returned a list, not a torch.optim.Optimizer."),
        (f"model.name={PKG}:model_frozen", "has no trainable parameters (all have requires_grad=False): "
         "optim.name=sgd would train nothing."),
        (f"model.name={PKG}:model_frozen optim.name=SGD", "optim.name=SGD: calling it raised ValueError: optimizer "
         "got an empty parameter list."),
    ],
)  # fmt: skip
def test_a_factory_that_fails_is_exit_2_before_any_worker(tmp_path, started, override, message):
    result = CliRunner().invoke(main, ["train", *SMALL, "--output-dir", str(tmp_path / "out"), *override.split()])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert result.output.count("Traceback") == (1 if "raised" in message else 0)
    assert started == [] and not (tmp_path / "out").exists()  # no worker, no folder


@pytest.mark.parametrize(("optim", "builds"), [("optim.name=adamw", False), ("optim.name=Adam", True)])
def test_sgd_and_adamw_over_the_models_parameters_are_not_built_before_the_workers(
    tmp_path, monkeypatch, started, optim, builds
):
    """Building one imports torch._dynamo (a second or more) in the launcher, which never trains; they can refuse
    only an empty parameter list, checked without them (above). Any other optimizer is built on the meta model."""
    from ignite_mgpu.train import optim as optim_module

    built = []
    real = optim_module.create_optimizer
    monkeypatch.setattr(optim_module, "create_optimizer", lambda *a, **k: built.append(k["name"]) or real(*a, **k))
    args = ["train", *SMALL, "--output-dir", str(tmp_path / "out"), "model.name=tests.plugins_pkg.factories:net", optim]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert built == (["Adam"] if builds else []) and len(started) == 1


def test_a_model_that_cannot_be_built_on_meta_is_left_to_the_workers(tmp_path, started):
    args = ["train", *SMALL, "--output-dir", str(tmp_path / "out"), f"model.name={PKG}:model_reads_values"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "cannot be built on the meta device" in result.output and "checked in the workers instead" in result.output
    assert len(started) == 1


@pytest.mark.parametrize("what", ["fifo", "device"])
def test_a_factory_module_that_is_not_a_regular_file_is_one_paragraph(tmp_path, monkeypatch, started, what):
    """`model.name=fifomod:make` where fifomod.py is a FIFO or a symlink to /dev/zero: Python's importer takes only
    regular files as modules (it never opens these, so nothing blocks or reads without end); the paragraph says
    what the file is."""
    monkeypatch.chdir(tmp_path)
    module = tmp_path / f"{what}mod.py"
    os.mkfifo(module) if what == "fifo" else os.symlink("/dev/zero", module)
    args = ["train", *SMALL, "--output-dir", str(tmp_path / "out"), f"model.name={what}mod:make"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"model.name={what}mod:make: cannot import module '{what}mod'" in said
    kind = "a FIFO (named pipe)" if what == "fifo" else "a symlink to a character device"
    assert f"({module} is {kind}, not a regular file; a module must be a regular file)" in said and not started
