"""The front door as a new user meets it: a command run in a real (pseudo-)terminal, in an environment that has only
the package's declared dependencies.

``declared_only(folder)`` makes a folder for PYTHONPATH whose ``sitecustomize`` makes every module of an installed
distribution that ``pip install -e .`` would not have brought (the ``dev`` extra's, and what they pulled in) fail to
import with ``ModuleNotFoundError``, as it would after the README's install, in this process's children too (the
fork server, the workers). The list is computed from ``setup.cfg``'s ``install_requires`` and the installed
distributions' own requirements. ``in_terminal`` runs a command with a pseudo-terminal as its stdin, stdout and
stderr, and returns its exit code and everything it showed.
"""

from __future__ import annotations

import configparser
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
UNDECLARED = "IGNITE_MGPU_TEST_UNDECLARED"

_SITECUSTOMIZE = f'''"""Modules of distributions the package does not declare cannot be imported (tests/terminal.py)."""
import importlib.abc
import os
import sys

_BLOCKED = frozenset(os.environ.get("{UNDECLARED}", "").split(","))


class _Undeclared(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not installed by pip install -e .)", name=name)
        return None


sys.meta_path.insert(0, _Undeclared())
'''


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements() -> list[str]:
    """``install_requires`` of setup.cfg, as written (comments dropped)."""
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    lines = (line.split("#")[0].strip() for line in parser["options"]["install_requires"].splitlines())
    return [line for line in lines if line]


def installed_closure(requirements: list[str]) -> set[str]:
    """The distributions that installing ``requirements`` brings: each one's own requirements, without extras."""
    from packaging.requirements import Requirement

    needed: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        if name in needed or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        needed.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(name) or []]
        except metadata.PackageNotFoundError:
            pass
    return needed


def undeclared_modules() -> set[str]:
    """Top-level modules of installed distributions outside the declared closure (and outside the standard
    library)."""
    needed = installed_closure(declared_requirements()) | {"ignite-mgpu", "pip", "setuptools"}
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if module not in sys.stdlib_module_names and not any(_canonical(d) in needed for d in dists)
    }


def declared_only(folder: Path, package: Path = REPO) -> dict[str, str]:
    """The environment variables that give a child only the declared dependencies, with ``package`` (the folder
    that holds ``ignite_mgpu``: the checkout, or ``docs_blocks.installed_only``'s) on PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return {"PYTHONPATH": f"{folder}{os.pathsep}{package}", UNDECLARED: ",".join(sorted(undeclared_modules()))}


def in_terminal(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with a 100x30 pseudo-terminal as its stdin, stdout and stderr, in its own session; returns its
    exit code and what it wrote. Its whole group is killed if it outlives ``timeout`` (exit code -9 then)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    shown, deadline = bytearray(), time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([master], [], [], min(left, 1.0))[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every process holding the terminal has closed it
                    break
                if not data:
                    break
                shown += data
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
    return code, shown.decode(errors="replace")
