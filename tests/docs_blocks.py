"""The code blocks of the documentation (docs/**/*.md), read the way tests/test_docs.py checks them: a block is a
copy of a file the suite runs, named by a comment line ``<!-- same as: examples/... -->`` just above it (the page
shows the code itself, so that a reader of the repository sees it too; the test keeps the two equal), marked by a
comment line ``<!-- not run: <reason> -->`` just above it (the reader sees the block's title, which speaks to them:
"Needs NVIDIA GPUs"), named by a comment line ``<!-- block: NAME -->`` just above it (a test runs it by that name,
with its own assertions), or run as it is by tests/test_docs.py. A tutorial's files are the blocks whose title is a
relative path (``my_project/data.py``): ``write_files`` writes them into an empty folder, as the reader does."""

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
_NOT_RUN = re.compile(r"^ *<!-- not run: (?P<why>.*\S.*) -->$")
_SAME_AS = re.compile(r"^ *<!-- same as: (?P<path>\S+) -->$")
_FILE_TITLE = re.compile(r"^[\w.-]+(?:/[\w.-]+)*\.\w+$")  # a relative path: my_project/data.py, config.yaml
_TITLE = re.compile(r'title="(?P<title>[^"]*)"')


@dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    line: int
    lang: str
    title: str
    name: str
    text: str
    why_not_run: str = ""  # <!-- not run: REASON --> above it
    source: str = ""  # <!-- same as: PATH --> above it: the file of the repository it copies
    indent: int = 0  # the fence's indentation: more than 0 in a list item

    @property
    def not_run_here(self) -> bool:
        return bool(self.why_not_run)

    @property
    def is_file(self) -> bool:
        """A file the reader writes: its title is the path, relative to their folder."""
        return bool(_FILE_TITLE.match(self.title))

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
        why = w["why"] if i and (w := _NOT_RUN.match(lines[i - 1])) else ""
        source = s["path"] if i and (s := _SAME_AS.match(lines[i - 1])) else ""
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```" and lines[j].startswith(indent))
        text = "\n".join(line[len(indent) :] for line in lines[i + 1 : end])
        found.append(
            Block(str(page.relative_to(DOCS)), i + 1, lang, title, name, text + "\n", why, source, len(indent))
        )
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in sorted(DOCS.rglob("*.md")) for b in blocks(page)]


def doc_block(name: str) -> Block:
    """The block named ``name`` (``<!-- block: NAME -->``); exactly one page has it."""
    (block,) = [b for b in all_blocks() if b.name == name]
    return block


def write_files(page: str, folder: Path) -> list[Path]:
    """Write every file block of ``page`` (relative to docs/) into ``folder``, as the page shows it: what a reader
    following the page from an empty folder has written."""
    written = []
    for block in blocks(DOCS / page):
        if block.is_file:
            path = folder / block.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.text)
            written.append(path)
    return written


def installed_only(folder: Path) -> Path:
    """A folder for PYTHONPATH that holds the package and nothing else of the repository: as after
    ``pip install ignite-mgpu`` (no configs/, examples/ or tests/ to import or read)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ignite_mgpu").symlink_to(DOCS.parent / "ignite_mgpu")
    return folder


def sandbox(folder: Path) -> Path:
    """A working folder as a user's checkout would be: configs/ and examples/ at hand, nothing written into the
    repository."""
    repo = DOCS.parent
    for name in ("configs", "examples"):
        (folder / name).symlink_to(repo / name)
    return folder


def run_block(block: Block, cwd: Path, timeout: float = 150, pythonpath: Path | None = None):
    """Run a block as written, in its own session with a hard timeout: bash with -euo pipefail, or python; the
    ignite-mgpu and python of this environment (``pythonpath``: where the package is found, by default the
    repository). Fails the test on a non-zero exit."""
    from tests.conftest import run_in_session

    path = str(pythonpath or DOCS.parent)
    env = {**os.environ, "PYTHONPATH": path, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    if block.lang in {"python", "py"}:
        cmd = [sys.executable, "-c", block.text]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.text]
    result = run_in_session(cmd, timeout, cwd, env)
    assert result.returncode == 0, f"{block.id}\n{block.text}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result
