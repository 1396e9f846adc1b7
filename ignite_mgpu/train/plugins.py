"""The user's own code named in the config as ``package.module:factory`` (``model.name``, ``data.name``,
``train.loss``, ``eval.metrics``): imported with the working directory importable, as ``python -m`` makes it,
checked against the keyword arguments the config gives it, called; every failure a ConfigError naming the config
key. Torch-free."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs.regular import why_not_regular

FORM = "package.module:factory"


def is_factory(name: str) -> bool:
    return ":" in name


def resolve(name: str, key: str) -> Callable[..., Any]:
    """The callable that ``name`` ("package.module:attr", attr may be dotted) names; ``key`` is its config key."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}={name!r} is not of the form {FORM}, e.g. {key}=mypkg.data:build.")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does; spawned workers inherit sys.path
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise ConfigError(
                f"{key}={name}: cannot import module '{module_name}' (no module named '{err.name}')"
                f"{_not_a_module_file(module_name)}. Install the package, or start from the folder that holds it "
                "(the working directory is importable)."
            ) from None
        raise _user_code_failed(key, name, f"importing '{module_name}'", err) from None
    except Exception as err:  # the user's module itself raised while it was imported
        raise _user_code_failed(key, name, f"importing '{module_name}'", err) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}={name}: module '{module_name}' has no attribute '{attr}'. Check the spelling.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}={name} is a {type(obj).__name__}, not a function or class that can be called.")
    return obj


def _not_a_module_file(module_name: str) -> str:
    """Python's importer takes only regular files as modules (a FIFO or a device is never opened, so never blocks):
    when the module's name in the working directory is something else, say so rather than "no module"."""
    path = os.path.join(os.getcwd(), *module_name.split(".")) + ".py"
    why = why_not_regular(path) if os.path.lexists(path) else None
    return f" ({path} {why}; a module must be a regular file)" if why else ""


def accepts(fn: Callable[..., Any], parameter: str) -> bool:
    """Whether ``fn`` takes ``parameter`` as a keyword argument (by name, or through ``**kwargs``)."""
    params = _parameters(fn)
    return params is None or parameter in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def with_extras(fn: Callable[..., Any], args: Mapping[str, Any], **extras: Any) -> dict[str, Any]:
    """``args`` plus each of ``extras`` that ``fn`` takes and ``args`` does not give (a metric's ``device``)."""
    return {**{k: v for k, v in extras.items() if k not in args and accepts(fn, k)}, **args}


def check_arguments(fn: Callable[..., Any], kwargs: Mapping[str, Any], name: str, args_key: str) -> None:
    """ConfigError unless ``fn(**kwargs)`` binds: no unknown keyword, no required parameter left out."""
    params = _parameters(fn)
    if params is None or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown: list[str] = []
    else:
        named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = sorted(set(kwargs) - named)
    takes = ", ".join(n for n, p in (params or {}).items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if unknown:
        raise ConfigError(
            f"{args_key} gives {', '.join(unknown)}, which {name} does not accept (it takes: {takes or 'nothing'}). "
            f"Remove {'it' if len(unknown) == 1 else 'them'} or fix the spelling."
        )
    missing = [
        n
        for n, p in (params or {}).items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in kwargs
    ]
    if missing:
        raise ConfigError(
            f"{name} needs {', '.join(missing)}, which {args_key} does not give: add "
            f"{' '.join(f'{args_key}.{m}=...' for m in missing)}."
        )


def call(fn: Callable[..., Any], kwargs: Mapping[str, Any], name: str, key: str) -> Any:
    """``fn(**kwargs)``; an exception in the user's code becomes a ConfigError with the user's traceback as detail."""
    try:
        return fn(**kwargs)
    except Exception as err:
        raise _user_code_failed(key, name, "calling it", err) from None


def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature: nothing to check
        return None


def _user_code_failed(key: str, name: str, when: str, err: BaseException) -> ConfigError:
    """One paragraph, with the traceback of the user's frames only (ours are noise to them) as its detail."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = os.path.dirname(__file__)
    mine = [f for f in frames if not f.filename.startswith(ours) and "importlib" not in f.filename]
    detail = "Traceback (most recent call last):\n" + "".join(traceback.format_list(mine))
    detail += "".join(traceback.format_exception_only(type(err), err))
    return ConfigError(f"{key}={name}: {when} raised {type(err).__name__}: {err}.", detail)
