"""Goodput's start: the interpreter's for the CLI, so that a shell that ran an install and then exec'd
``ignite-mgpu train`` does not count the install as start-up; the process's for Python code.
`python -m pytest tests/env/test_clock.py`."""

import json
import subprocess
import sys
import time

from click.testing import CliRunner

from ignite_mgpu.cli.commands import main
from ignite_mgpu.env import clock
from tests.conftest import REPO

# Printed by a Python that a shell exec'd after a 2 s "install".
PROBE = (
    "import json, time; from ignite_mgpu.env import clock; "
    "print(json.dumps([clock.process_start(), clock.interpreter_start(), time.time()]))"
)


def test_after_a_shells_exec_the_interpreters_start_leaves_out_what_the_shell_ran_first():
    shell = f"sleep 2 && exec {sys.executable} -c '{PROBE}'"
    done = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    process, interpreter, now = json.loads(done.stdout)
    assert now - process >= 2.0  # the shell's process: its sleep counts
    assert interpreter - process >= 1.5 and interpreter <= now  # the interpreter began after the sleep


def test_without_an_exec_the_interpreter_started_with_its_process():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    process, interpreter, now = json.loads(done.stdout)
    assert process <= interpreter <= now and interpreter - process < 1.0


def test_the_cli_counts_from_the_interpreters_start_and_python_code_from_the_processs(monkeypatch):
    monkeypatch.setattr(clock, "_command_start", [])
    assert clock.command_start() == clock.process_start()  # fit() from a script: its own start-up counts
    result = CliRunner().invoke(main, ["devices", "--json"])
    assert result.exit_code == 0, result.output
    assert clock.command_start() == clock.interpreter_start() <= time.time()
    assert clock.first_attempt().started == clock.interpreter_start()  # a job's first attempt, from then on
