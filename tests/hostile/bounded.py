"""Running the CLI on hostile input with its memory and its time bounded: every process of the job gets an
address-space limit (RLIMIT_AS, inherited by the workers), the job its own session and a hard timeout. Used by
tests/hostile; a hostile path must end in one paragraph, never a hang or a read without end."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Each process: importing torch maps about 3.5 GiB of address space; a read of /dev/zero without end passes any
# bound above that within seconds.
ADDRESS_SPACE = 8 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_bounded(args: list[str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    """``python -m ignite_mgpu ARGS`` under the memory limit, in its own session, killed as a group (failing the
    test) past ``timeout``. The result carries ``seconds``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ignite_mgpu", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_limit_memory,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{args} did not finish in {timeout} s\n{out[-2000:]}\n{err[-2000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    result.seconds = time.monotonic() - start  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5  # a process that is exiting (the resource tracker, at its pipe's end) may linger
    while (left := left_in_session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    result.left = left  # type: ignore[attr-defined]
    return result


def left_in_session(session: int) -> list[str]:
    """The processes still alive in ``session`` (its leader's pid), as "pid command"."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")[:200]
            left.append(f"{stat.parent.name} {command!r}")
    return left


def one_paragraph(text: str) -> str:
    """The error's paragraph: the stderr of a command that failed before anything started, with no traceback."""
    assert "Traceback" not in text, text
    return " ".join(text.split())
