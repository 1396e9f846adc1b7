"""Every config key with its type, default and meaning, read from the schema's dataclasses (the one-line comment
after each field is its meaning), and the configuration written as commented YAML: what ``ignite-mgpu config``
prints and the reference page lists. The schema ships with the package, so this needs no file of the repository."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Any

from ignite_mgpu.config.schema import Config


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its dotted name, annotation as written, default as YAML writes it, and meaning."""

    name: str
    type: str
    default: str
    meaning: str


def yaml_value(value: Any) -> str:
    """A value as YAML writes it on one line (``null``, ``true``, ``{}``, ``[0.9, 0.95]``, a quoted odd string)."""
    import yaml  # PyYAML comes with OmegaConf

    written = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return written.removesuffix("...").strip()


def _comments(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (annotation source, the comment on the field's lines) of a dataclass, read from its source."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {
        tok.start[0]: tok.string.lstrip("# ").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    found = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            lines = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
            comment = next((comments[n] for n in lines if n in comments), "")
            found[stmt.target.id] = (ast.unparse(stmt.annotation), comment)
    return found


def config_keys(cls: type = Config, prefix: str = "") -> list[Key]:
    """Every leaf key of the configuration, in the dataclasses' order; a field without its comment is an error."""
    hints = typing.get_type_hints(cls)
    written = _comments(cls)
    keys: list[Key] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys.extend(config_keys(typing.cast(type, hint), f"{prefix}{f.name}."))
            continue
        annotation, meaning = written[f.name]
        if not meaning:
            raise ValueError(f"{cls.__name__}.{f.name} has no one-line comment: the reference needs its meaning")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        keys.append(Key(f"{prefix}{f.name}", annotation, yaml_value(default), meaning))
    return keys


def sections() -> dict[str, str]:
    """YAML section -> what it holds (its dataclass's first docstring line, without the `name:` in front)."""
    hints = typing.get_type_hints(Config)
    return {
        f.name: (inspect.getdoc(hints[f.name]) or "").splitlines()[0].split(" ", 1)[-1]
        for f in dataclasses.fields(Config)
        if dataclasses.is_dataclass(hints[f.name])
    }


def commented_yaml(cfg: Config | None = None) -> str:
    """``cfg`` (None: the defaults) as YAML, every key on its own line with its meaning as a comment: a file that
    ``ignite-mgpu train FILE`` reads back as the same configuration."""
    cfg = cfg or Config()
    meanings = {k.name: k.meaning for k in config_keys()}
    out = [
        "# ignite-mgpu's configuration: every key, its value and its meaning.",
        "# Precedence: these defaults < a YAML file (ignite-mgpu train my.yaml) < key=value overrides < flags.",
    ]
    described = sections()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name not in described:
            out.append(f"{f.name}: {yaml_value(value)}  # {meanings[f.name]}")
            continue
        out.append(f"{f.name}:  # {described[f.name]}")
        for sub in dataclasses.fields(value):
            out.append(f"  {sub.name}: {yaml_value(getattr(value, sub.name))}  # {meanings[f'{f.name}.{sub.name}']}")
    return "\n".join(out) + "\n"
