"""``ignite-mgpu config``: every key with its value and meaning, from the package alone (no file of the clone),
a YAML file that train reads back as the same configuration; the key-typo messages point to it.

    pytest tests/test_config_command.py -q
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.keys import config_keys
from ignite_mgpu.config.loading import dotted_keys, load_config
from ignite_mgpu.config.schema import Config


def _config(*args: str) -> str:
    result = CliRunner().invoke(main, ["config", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_every_key_is_printed_with_its_default_and_meaning(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty folder: nothing of the repository is read
    lines = _config().splitlines()
    for key in config_keys():
        section, _, name = key.name.rpartition(".")
        assert f"{'  ' if section else ''}{name}: {key.default}  # {key.meaning}" in lines, key
    assert len([ln for ln in lines if not ln.startswith("#")]) == len(dotted_keys()) + 7  # 7 section lines


def test_what_it_prints_is_read_back_as_the_same_configuration(tmp_path: Path):
    overrides = ("optim.name=Adam", "data.batch_size=64", "train.loss_args.label_smoothing=0.1")
    (tmp_path / "my.yaml").write_text(_config(*overrides))
    cfg = load_config(tmp_path / "my.yaml")
    assert cfg == load_config(None, overrides)
    assert cfg != Config() and load_config(None) == Config()
    assert dataclasses.asdict(load_config(tmp_path / "my.yaml"))["train"]["loss_args"] == {"label_smoothing": 0.1}


def test_a_mistyped_key_points_to_the_command():
    result = CliRunner().invoke(main, ["config", "optim.lrr=0.1"])
    assert result.exit_code == 2
    assert "did you mean optim.lr=0.1?" in result.output
    assert "`ignite-mgpu config` lists every key with its default and meaning." in result.output
    flag = CliRunner().invoke(main, ["train", "--epochs", "3"])
    assert flag.exit_code == 2 and "train.epochs=3? (`ignite-mgpu config` lists every key)" in flag.output
