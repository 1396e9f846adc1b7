"""--gpus and --wait parsed strictly, as typed: 0x1 is not GPU 1, '' is not unset, 010 is GPU 10 (not YAML's
octal 8), --wait -1 is a bad number of seconds (not "no such option: -1"). `python -m pytest tests/hostile`."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.loading import load_config


@pytest.mark.parametrize("command", ["train", "plan", "evaluate"])
@pytest.mark.parametrize("value", ["0x1", "", "1e0", "+1", "1,,2", "-1"])
def test_gpus_outside_the_grammar_is_refused_as_typed(command, value):
    result = CliRunner().invoke(main, [command, "--gpus", value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--gpus': {value!r} is invalid" in " ".join(result.output.split())


@pytest.mark.parametrize(("value", "passed"), [("010", "10"), ("2, 3", "2,3"), ("AUTO:2", "auto:2"), ("none", "none")])
def test_gpus_is_passed_on_in_its_plain_form(value, passed):
    from ignite_mgpu.cli.options import gpus_value

    assert gpus_value(None, None, value) == passed
    assert load_config(None, [f"dist.gpus={passed}"]).dist.gpus == passed


@pytest.mark.parametrize("value", ["-1", "-0.5"])
def test_a_negative_wait_says_so(value):
    result = CliRunner().invoke(main, ["train", "--wait", value])
    assert result.exit_code == 2
    assert f"--wait {value}: not a number of seconds > 0" in result.output
    assert "no such option" not in result.output
