"""The code blocks of the documentation (docs/**/*.md), read the way tests/test_docs.py checks them: a block is
included from a file (``--8<-- "examples/..."``), visibly marked ``title="Not run here: <reason>"``, named by an
HTML comment line ``<!-- block: NAME -->`` just above it (a test runs it by that name, with its own assertions),
or run as it is by tests/test_docs.py."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
RUNNABLE = {"bash", "sh", "shell", "console", "python", "py"}
_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")
_NAME = re.compile(r"^ *<!-- block: (?P<name>[\w-]+) -->$")
_TITLE = re.compile(r'title="(?P<title>[^"]*)"')


@dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    line: int
    lang: str
    title: str
    name: str
    text: str

    @property
    def included(self) -> list[str]:
        return re.findall(r'^--8<-- "([^"]+)"$', self.text, flags=re.M)

    @property
    def not_run_here(self) -> bool:
        return self.title.startswith("Not run here:") and len(self.title) > len("Not run here: ")

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of one Markdown page, in order."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m["info"].strip():
            i += 1
            continue
        info, indent = m["info"].strip(), m["indent"]
        lang = info.split()[0].lstrip("{.").rstrip("}")
        title = t["title"] if (t := _TITLE.search(info)) else ""
        name = n["name"] if i and (n := _NAME.match(lines[i - 1])) else ""
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```" and lines[j].startswith(indent))
        text = "\n".join(line[len(indent) :] for line in lines[i + 1 : end])
        found.append(Block(str(page.relative_to(DOCS)), i + 1, lang, title, name, text + "\n"))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in sorted(DOCS.rglob("*.md")) for b in blocks(page)]


def doc_block(name: str) -> Block:
    """The block named ``name`` (``<!-- block: NAME -->``); exactly one page has it."""
    (block,) = [b for b in all_blocks() if b.name == name]
    return block


def sandbox(folder: Path) -> Path:
    """A working folder as a user's checkout would be: configs/ and examples/ at hand, nothing written into the
    repository."""
    repo = DOCS.parent
    for name in ("configs", "examples"):
        (folder / name).symlink_to(repo / name)
    return folder


def run_block(block: Block, cwd: Path, timeout: float = 150):
    """Run a block as written, in its own session with a hard timeout: bash with -euo pipefail, or python; the
    ignite-mgpu and python of this environment. Fails the test on a non-zero exit."""
    from tests.conftest import run_in_session

    env = {**os.environ, "PYTHONPATH": str(DOCS.parent), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    if block.lang in {"python", "py"}:
        cmd = [sys.executable, "-c", block.text]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.text]
    result = run_in_session(cmd, timeout, cwd, env)
    assert result.returncode == 0, f"{block.id}\n{block.text}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result
