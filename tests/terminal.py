"""The front door as a new user meets it: a command run in a real (pseudo-)terminal, in an environment that has only
the package's declared dependencies.

``declared_only(folder)`` makes a folder for PYTHONPATH whose ``sitecustomize`` takes the installed
site-packages off ``sys.path`` and puts in their place a folder of links to the declared distributions only (their
modules and their metadata), computed from ``setup.cfg``'s ``install_requires`` and the installed distributions' own
requirements: what the ``dev`` extra brought, or the machine had before, is not found at all (``find_spec`` answers
``None``, ``importlib.metadata`` does not list it), as after the README's install, in this process's children too
(the fork server, the workers). ``in_terminal`` runs a command with a pseudo-terminal as its stdin, stdout and
stderr, and returns its exit code and everything it showed.
"""

from __future__ import annotations

import configparser
import fcntl
import os
import re
import select
import signal
import site
import struct
import subprocess
import termios
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINKS = "IGNITE_MGPU_TEST_DECLARED_SITE"
HIDDEN = "IGNITE_MGPU_TEST_HIDDEN_SITES"

_SITECUSTOMIZE = f'''"""Only the declared distributions can be found (tests/terminal.py)."""
import importlib
import os
import sys

_hidden = set(os.environ["{HIDDEN}"].split(os.pathsep))
sys.path[:] = [entry for entry in sys.path if entry not in _hidden]
sys.path.append(os.environ["{LINKS}"])
sys.path_importer_cache.clear()
importlib.invalidate_caches()
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


def link_declared(links: Path) -> None:
    """Fill ``links`` with a link to every top-level entry (module, package, metadata folder) of the installed
    distributions that the package's install brings."""
    needed = installed_closure(declared_requirements()) | {"pip", "setuptools"}
    links.mkdir(parents=True, exist_ok=True)
    for dist in metadata.distributions():
        if _canonical(dist.metadata["Name"]) not in needed or _canonical(dist.metadata["Name"]) == "ignite-mgpu":
            continue
        for top in {Path(file).parts[0] for file in dist.files or []} - {".."}:
            target, link = Path(dist.locate_file(top)), links / top
            if target.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(target)


def declared_only(folder: Path, package: Path = REPO) -> dict[str, str]:
    """The environment variables that give a child only the declared dependencies, with ``package`` (the folder
    that holds ``ignite_mgpu``: the checkout, or ``docs_blocks.installed_only``'s) on PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    link_declared(folder / "declared")
    hidden = {*site.getsitepackages(), site.getusersitepackages()}
    return {
        "PYTHONPATH": f"{folder}{os.pathsep}{package}",
        LINKS: str(folder / "declared"),
        HIDDEN: os.pathsep.join(sorted(hidden)),
    }


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
