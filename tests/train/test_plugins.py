"""The user's own code named in the config: import, argument checks, calls, and errors that name the key and show
the user's traceback, not ours. `python -m pytest tests/train/test_plugins.py`."""

import pytest

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import plugins

PKG = "tests.plugins_pkg.factories"


def test_resolve_names_the_key_for_every_kind_of_mistake():
    assert plugins.resolve(f"{PKG}:pairs", "data.name").__name__ == "pairs"
    assert plugins.resolve(f"{PKG}:Net.forward", "model.name").__qualname__ == "Net.forward"  # dotted attributes
    cases = [
        ("nopkg.mod:build", r"data.name=nopkg.mod:build: cannot import module 'nopkg.mod' \(no module named 'nopkg'\)"),
        (f"{PKG}:nothing", rf"data.name={PKG}:nothing: module '{PKG}' has no attribute 'nothing'"),
        (f"{PKG}:NOT_CALLABLE", rf"data.name={PKG}:NOT_CALLABLE is a int, not a function or class"),
        (":build", r"data.name=':build' is not of the form package.module:factory"),
    ]
    for name, message in cases:
        with pytest.raises(ConfigError, match=message):
            plugins.resolve(name, "data.name")


def test_arguments_are_checked_against_the_signature():
    fn = plugins.resolve(f"{PKG}:pairs", "data.name")
    plugins.check_arguments(fn, {"n": 8}, "data.name=x", "data.args")
    with pytest.raises(
        ConfigError, match=r"data.args gives size, valu, which data.name=x does not accept \(it takes: n, val\)"
    ):
        plugins.check_arguments(fn, {"size": 1, "valu": 2}, "data.name=x", "data.args")

    def needs(path, block=64):
        return path

    with pytest.raises(ConfigError, match=r"needs path, which data.args does not give: add data.args.path=\.\.\."):
        plugins.check_arguments(needs, {}, "data.name=x", "data.args")
    assert plugins.accepts(needs, "block") and not plugins.accepts(needs, "num_classes")
    assert plugins.accepts(lambda **kw: None, "num_classes")


def test_an_exception_in_the_users_code_shows_their_traceback_not_ours():
    fn = plugins.resolve(f"{PKG}:raises", "data.name")
    with pytest.raises(ConfigError) as err:
        plugins.call(fn, {"n": 3}, f"{PKG}:raises", "data.name")
    assert str(err.value) == (f"data.name={PKG}:raises: calling it raised ValueError: cannot open shard 3.")
    detail = err.value.detail
    assert "_helper_that_fails" in detail and detail.rstrip().endswith("ValueError: cannot open shard 3")
    assert "ignite_mgpu" not in detail  # only the user's frames
