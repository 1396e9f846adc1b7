"""Shared fixtures: restore os.environ and tear down any process group after each test; run the CLI for real.

Run everything with `python -m pytest -q`; `-m "not distributed"` keeps to the in-process tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_cli(args: list[str], cwd: Path, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m ignite_mgpu ARGS` in its own session; kill the whole group if it outlives `timeout`."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(var, None)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ignite_mgpu", *args],
        cwd=cwd,
        env=full_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"ignite-mgpu {' '.join(args)} did not finish in {timeout} s\n{err[-3000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    result.seconds = time.monotonic() - start  # type: ignore[attr-defined]
    return result


# Small, fast settings shared by the CLI tests: 256 + 101 synthetic 16x16 images.
TINY = [
    "data.train_size=256",
    "data.val_size=101",
    "data.image_size=16",
    "data.batch_size=32",
    "train.epochs=2",
    "train.check_every=4",
]


def make_image_folder(root: Path, counts: dict[str, int], size: int, broken: str) -> Path:
    """An ImageNet-layout folder (root/<split>/{cat,dog}/<i>.png, ``counts`` images per class and split) plus one
    unreadable file at ``root/broken`` (e.g. "train/cat/broken.png"). Returns root."""
    from PIL import Image

    for split, n in counts.items():
        for cls in ("cat", "dog"):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (size, size), color=(10 * i, 200 if cls == "cat" else 20, 7)).save(folder / f"{i}.png")
    (root / broken).write_bytes(b"\x89PNG truncated")
    return root
