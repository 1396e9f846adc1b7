"""Loading a run's configuration, validated by OmegaConf structured configs (imported only when a config is loaded)
and ``config.checks``; dumping it as the run folder's config.yaml.

Precedence is fixed: dataclass defaults < ``--config FILE.yaml`` < dotted overrides (``optim.lr=0.05``).
"""

from __future__ import annotations

import io
import os
from typing import Any

from ignite_mgpu import text
from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.schema import Config
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs.regular import NotRegular, read_regular

YAML_BOOLEANS = frozenset("y Y yes Yes YES n N no No NO true True TRUE false False FALSE on On ON off Off OFF".split())
MAX_CONFIG_BYTES = 16 << 20  # a config file is a few KiB; anything this large is not one


def _paragraph(err: Exception, where: str) -> str:
    lines = str(err).splitlines()
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.strip().startswith("full_key:")), None)
    head = f"config key '{key}'" if key else "config"
    msg = lines[0] if lines[0].endswith((".", "?")) else lines[0] + "."
    return f"{head} ({where}): {msg} `ignite-mgpu config` lists every key with its default and meaning."


def dotted_keys() -> list[str]:
    """Every key as written on the command line (``train.epochs``), in the dataclasses' order."""
    return text.dotted(text.sections_of(Config()))


def _check_keys(layer: Any, where: str, overrides: list[str] | tuple[str, ...]) -> None:
    """Unknown keys of one layer (a YAML file, the overrides), down to the sections' keys: ``model.args`` and
    ``data.args`` take any key. The message suggests the key meant (``text.unknown_key``)."""
    sections = text.sections_of(Config())
    for key, value in layer.items():
        if key in sections and key != "":
            for sub in value if isinstance(value, dict) else ():
                if sub not in sections[key]:
                    raise ConfigError(text.unknown_key(f"{key}.{sub}", where, sections, overrides))
        elif key not in sections[""]:
            raise ConfigError(text.unknown_key(str(key), where, sections, overrides))


def _unparsable(overrides: list[str] | tuple[str, ...], err: Exception) -> str:
    """The override whose value is not YAML, and why (the first line of YAML's own message)."""
    from omegaconf import OmegaConf

    bad = next((o for o in overrides if not _parses(OmegaConf, o)), overrides[0])
    why = str(err).splitlines()[0] if str(err) else type(err).__name__
    return (
        f"override '{bad}': its value is not valid YAML ({why}). Quote a value with ':' or brackets in it, "
        "e.g. 'eval.metrics=[\"package.module:factory\"]'."
    )


def _parses(omegaconf: Any, override: str) -> bool:
    try:
        omegaconf.from_dotlist([override])
    except Exception:
        return False
    return True


def _yaml_where(err: Exception) -> str:
    """Where a YAML error is and what it is: " at line 3, column 3: found duplicate key batch_size (while
    constructing a mapping)", or the error's first line."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return f" ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    context = getattr(err, "context", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}{f' ({context})' if context else ''}"


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (), *, check: bool = True
) -> Config:
    """Build the run's `Config`: dataclass defaults, then the YAML file at ``path``, then dotted ``overrides``.
    ``check=False`` leaves the checks of values and combinations (``checks.validate``) to the caller, for one that
    runs them anyway (``fit``, ``evaluate``); keys and types are always checked.

    Raises:
        ConfigError: unknown key (with the closest key of any section), wrong type, bad value, unreadable YAML.
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(Config)
    layers: list[tuple[Any, str]] = []
    if path is not None:
        try:
            text = read_regular(path, MAX_CONFIG_BYTES).decode("utf-8", errors="replace")
        except NotRegular as err:
            raise ConfigError(
                f"--config {path}: {err.args[0].removeprefix(str(path) + ' ')}. Pass the path of a YAML file, such as "
                "the one `ignite-mgpu config > my.yaml` writes."
            ) from None
        try:
            # yaml.SafeLoader underneath: no code runs.
            layers.append((OmegaConf.load(io.StringIO(text)), f"from {path}"))
        except Exception as err:  # yaml.YAMLError and friends: report the file, not a traceback
            raise ConfigError(f"--config {path}: not valid YAML{_yaml_where(err)}. Fix the file's syntax.") from None
        if not isinstance(layers[-1][0], DictConfig):
            raise ConfigError(
                f"--config {path}: its top level is a list, not a mapping of sections. Write the sections as keys "
                "(data:, model:, train:, ...), as `ignite-mgpu config` prints them."
            )
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"override '{bad[0]}' is not of the form key=value, e.g. optim.lr=0.05 or train.epochs=3.")
    if overrides:
        try:
            layers.append((OmegaConf.from_dotlist(list(overrides)), "from the command line"))
        except OmegaConfBaseException as err:
            raise ConfigError(_paragraph(err, "from the command line")) from None
        # A value YAML cannot parse (yaml.ScannerError): the override, not a traceback.
        except Exception as err:
            raise ConfigError(_unparsable(overrides, err)) from None
    merged = schema
    for layer, where in layers:
        _check_keys(OmegaConf.to_container(layer), where, overrides)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise ConfigError(_paragraph(err, where)) from None
    # to_object returns the dataclass.
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    if check:
        validate(cfg)
    return cfg


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML (written to output_dir/config.yaml by rank 0), the text OmegaConf's
    ``to_yaml`` gives, written by PyYAML alone: importing OmegaConf would cost rank 0 a quarter of a second before
    its first step. A string that OmegaConf would read back as a number or a boolean is quoted."""
    import dataclasses

    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="'" if _typed(value) else None)

    Dumper.add_representer(str, string)
    return yaml.dump(dataclasses.asdict(cfg), Dumper=Dumper, sort_keys=False, allow_unicode=True)


def _typed(value: str) -> bool:
    """Whether OmegaConf quotes ``value`` when it writes YAML: a boolean of YAML 1.1 or a number as Python reads
    one (1e-3, inf); PyYAML quotes the rest that needs it."""
    if value in YAML_BOOLEANS:
        return True
    try:
        float(value)
    except ValueError:
        return False
    return True
