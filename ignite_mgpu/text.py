"""How messages write counts, lists of ids and the config key a user meant, and flags for a Python caller (as the
config keys they set): one spelling everywhere. Torch-free, a leaf like errors.py."""

from __future__ import annotations

import contextvars
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def user_name(uid: int) -> str:
    """A user's login name for a message, or "uid N" where the system knows none."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return f"uid {uid}"


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, pluralised: (1, "process") -> "1 process", (2, "process") -> "2 processes"."""
    return f"{count} {noun}{'' if count == 1 else 'es' if noun.endswith('s') else 's'}"


def score(value: Any) -> str:
    """A metric as the epoch line shows it: 4 decimals (0.1541), 4 significant digits where those would hide it
    (1.235e-05, 1.235e+06); anything else as it is."""
    if isinstance(value, float):
        return f"{value:.4f}" if 1e-3 <= abs(value) < 1e5 or value == 0 else f"{value:.4g}"
    return str(value)


def size(n: float) -> str:
    """Bytes as people read them: 812 B, 39.9 KiB, 12.3 MiB, 1.50 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def format_ids(ids: Iterable[int]) -> str:
    """Ids (GPUs, CPUs) as one list, sorted, runs of three or more as ranges: [0, 1, 2, 3, 8] -> "0-3,8",
    [2, 3] -> "2,3". The kernel's cpulist format and ``taskset -c`` read both forms."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) >= 3 else ",".join(map(str, r)) for r in runs)


def sections_of(defaults: Any) -> dict[str, list[str]]:
    """A config dataclass's sections -> their keys ("" holds the top-level keys)."""
    sections: dict[str, list[str]] = {"": []}
    for f in dataclasses.fields(defaults):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            sections[f.name] = [g.name for g in dataclasses.fields(value)]
        else:
            sections[""].append(f.name)
    return sections


def dotted(sections: Mapping[str, Sequence[str]]) -> list[str]:
    """Every key as written on the command line (``train.epochs``), in the sections' order."""
    return [f"{s}.{k}" if s else k for s, keys in sections.items() for k in keys]


def unknown_key(key: str, where: str, sections: Mapping[str, Sequence[str]], overrides: Sequence[str] = ()) -> str:
    """The paragraph for a key no section has: the same name in another section (``epochs`` -> ``train.epochs``),
    else the closest key of its section (``optim.lrr`` -> ``optim.lr``), else the closest name anywhere; with the
    override's value, so that the suggestion can be pasted."""
    import difflib  # here: the CLI imports this module, and --help stays fast

    section, _, name = key.rpartition(".")
    every = dotted(sections) + [s for s in sections if s]
    near = [f"{section}.{k}" if section else k for k in difflib.get_close_matches(name, sections[section], n=1)]
    moved = [k for k in every if k.rpartition(".")[2] == name]
    last = {k.rpartition(".")[2]: k for k in reversed(every)}
    guess = moved or near or [last[k] for k in difflib.get_close_matches(name, list(last), n=1, cutoff=0.7)]
    value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), None)
    place = f"not a key of section {section}" if section else "not a top-level key"
    if guess:
        hint = f"; did you mean {guess[0]}{'' if value is None else '=' + value}?"
    else:
        hint = f" (its keys: {', '.join(sections[section])})."
    listed = "`ignite-mgpu config` lists every key with its default and meaning."
    return f"config key '{key}' ({where}) is {place}{hint} {listed}"


# Set by the ignite-mgpu command: its messages name its flags; a Python caller (fit, evaluate) is told config keys.
ON_COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("ignite_mgpu_on_command_line", default=False)

# A flag and the value after it, where that is a value (auto, none, all, or a token with a digit, dot, slash, colon
# or comma): "--resume auto", "--gpus 2,3", "--resume runs/a/checkpoint_4.pt"; "--output-dir" alone.
_FLAG = re.compile(r"--([a-z][a-z-]*)(?: (auto|none|all|[\w*-]*[\d./:,][\w.,:/*-]*))?")


def as_settings(message: str, keys: Sequence[str]) -> str:
    """A message written for the command line, said to a Python caller: each flag named as the config key it sets,
    in the form ``load_config``'s overrides take (``--resume auto`` -> ``resume=auto``, ``--output-dir`` ->
    ``output_dir``, ``--gpus 2,3`` -> ``dist.gpus=2,3``); a flag that sets no key stays as it is."""
    by_name: dict[str, str] = {}
    for key in keys:  # top-level keys first: output_dir, resume
        by_name.setdefault(key.rpartition(".")[2], key)

    def setting(found: re.Match[str]) -> str:
        key = by_name.get(found[1].replace("-", "_"))
        if key is None:
            return found[0]
        return f"{key}={found[2]}" if found[2] else key

    return _FLAG.sub(setting, message)
