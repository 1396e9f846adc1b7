"""The README's first command as a new user runs it: in a terminal (a pseudo-terminal: the progress bar, every
worker's output relayed through a terminal of its own), after ``pip install -e .`` only (tests/terminal.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.terminal import REPO, declared_only, in_terminal

pytestmark = pytest.mark.slow


def first_command() -> str:
    """The README's first command, after its install."""
    block = (REPO / "README.md").read_text().split("```bash\n")[1].split("```")[0].strip()
    install, _, command = block.partition(" && ")
    assert install == "pip install -e .", block
    return command


@pytest.mark.timeout(240)
def test_the_readmes_first_command_in_a_terminal_after_the_readmes_install(tmp_path: Path) -> None:
    env = {**os.environ, **declared_only(tmp_path / "site"), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED"):
        env.pop(var, None)
    # What the dev extra brings is out of reach, what the package declares is not.
    probe = "import tqdm, ignite.contrib.handlers.tqdm_logger\ntry:\n import pytest\nexcept ImportError: print('no')"
    seen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert seen.stdout == "no\n", seen.stderr[-2000:]

    code, shown = in_terminal(["bash", "-c", first_command()], tmp_path, env, timeout=200)
    assert code == 0, shown[-4000:]
    assert re.search(r"epoch 2 \| train_loss [\d.]+ \| val_loss [\d.]+ \| val_acc 0\.9\d+", shown), shown[-4000:]
    assert "INFO finished: 2 epochs" in shown
    assert "%|" in shown  # the progress bar, drawn in the terminal of rank 0
    assert (tmp_path / "runs").is_dir()
