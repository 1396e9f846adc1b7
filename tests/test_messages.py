"""What the package says stands without the repository: no message, help text or key meaning names a file of the
clone (configs/, examples/, tests/, benchmarks/, tools/, docs/, README), which a user who installed the package does
not have. Reads the package's source with ``ast``: every string it can print, docstrings aside (but the CLI's, which
are its help).

    pytest tests/test_messages.py -q
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.keys import config_keys
from tests.conftest import REPO

PACKAGE = REPO / "ignite_mgpu"
# A path into the repository: one of its top-level folders, or its Markdown files by name.
REPOSITORY_PATH = re.compile(
    r"(?<![\w/.-])(?:configs|examples|tests|benchmarks|tools|docs)/[\w.*<]|README|CONTRIBUTING"
)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def printable_strings(file: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant of ``file`` that can reach a user: not a docstring, except in cli/
    (a command's docstring is its --help)."""
    tree = ast.parse(file.read_text())
    skipped = set() if file.parent.name == "cli" else _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped
    ]


def test_no_message_names_a_file_of_the_repository():
    named = [
        f"{file.relative_to(REPO)}:{line}: {text!r}"
        for file in sorted(PACKAGE.rglob("*.py"))
        for line, text in printable_strings(file)
        if REPOSITORY_PATH.search(text)
    ]
    assert not named, "\n".join(named)


def test_no_key_meaning_names_a_file_of_the_repository():
    assert not [k for k in config_keys() if REPOSITORY_PATH.search(k.meaning)]


def test_the_check_sees_a_planted_path(tmp_path: Path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""Docstring: configs/debug.yaml is fine here."""\nraise ValueError("see configs/debug.yaml")\n'
    )
    assert [text for _, text in printable_strings(planted) if REPOSITORY_PATH.search(text)] == [
        "see configs/debug.yaml"
    ]


def test_every_command_help_stands_without_the_repository():
    runner = CliRunner()
    for command in [[], *([name] for name in main.commands)]:
        shown = runner.invoke(main, [*command, "--help"]).output
        assert not REPOSITORY_PATH.search(shown), (command, shown)
