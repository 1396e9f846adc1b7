"""Shared fixtures: restore os.environ and tear down any process group after each test; run the CLI for real.

Run everything with `python -m pytest -q`; `-m "not slow"` is the fast tier, without the multi-process jobs (every
`distributed` test is also `slow`: collection refuses one that is not).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


# Set by pytest and by libraries themselves (torchvision's import sets torch inductor's cache folder once).
NOT_A_LEAK = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def _no_leaked_environment():
    """Fail a test that changes os.environ without monkeypatch (a leak would change every later test), then
    restore it; also tear down a process group the test left."""
    saved = dict(os.environ)
    yield
    changed = set(saved) | set(os.environ)
    leaked = sorted(k for k in changed - NOT_A_LEAK if saved.get(k) != os.environ.get(k))
    os.environ.clear()
    os.environ.update(saved)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    from ignite_mgpu.env import stop

    stop.reset()  # a stop requested in one test must not stop the next one's trainer
    if leaked:
        pytest.fail(f"the test changed os.environ without monkeypatch: {leaked}")


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A one-process gloo group: DDP and fully_shard work as on N ranks. idist, which finds it, forgets it after (the
    autouse teardown above destroys the group if a test leaves one)."""
    import ignite.distributed as idist
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "0")  # as a launcher sets it: idist need not guess it from the host names
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    idist.finalize()


@pytest.fixture(autouse=True)
def _private_claims_dir(_no_leaked_environment, tmp_path_factory, monkeypatch):
    """GPU claims (gpus/claims.py) in a folder of the test's own, never the machine's shared one; the test's
    child processes inherit it."""
    monkeypatch.setenv("IGNITE_MGPU_CLAIMS_DIR", str(tmp_path_factory.mktemp("claims")))


def _dirs_without_nvidia_smi(path: str) -> str:
    return os.pathsep.join(d for d in path.split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists())


@pytest.fixture(autouse=True)
def _cpu_only(request, _no_leaked_environment, monkeypatch):
    """Every test without the ``gpu`` marker runs as on a machine without GPUs, also on a GPU server: CUDA hidden
    in this process (torch.cuda may have counted the GPUs already) and in every process it starts, NVML and
    nvidia-smi unreachable. Tests that need devices inject a recorded snapshot (tests/gpus/test_gpus.py). It
    depends on _no_leaked_environment so that monkeypatch is undone before the leak check runs."""
    if "gpu" in request.keywords:
        return
    _hide_gpus(monkeypatch)


def _hide_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ignite_mgpu.gpus import inventory
    from ignite_mgpu.processes import machine

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PATH", _dirs_without_nvidia_smi(os.environ.get("PATH", "")))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(inventory, "_run_nvidia_smi", _no_nvidia_smi)
    # The plan asks torch.cuda (which tests patch to show GPUs) only where a GPU driver is installed: pretend one is.
    # The jobs the tests launch run on this machine as it is (tests/test_preflight.py: no driver, no torch there).
    monkeypatch.setattr(machine, "GPU_DRIVER_FILES", ("/",))


@contextlib.contextmanager
def cpu_only(claims_dir: Path) -> Iterator[None]:
    """What _cpu_only and _private_claims_dir give a test, for a job that a module-scoped fixture starts (launch()
    here, or the CLI in a child): such a fixture runs before the function-scoped autouse fixtures. Undone after."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _hide_gpus(monkeypatch)
        monkeypatch.setenv("IGNITE_MGPU_CLAIMS_DIR", str(claims_dir))
        yield


def _no_nvidia_smi(argv):
    raise FileNotFoundError("nvidia-smi (hidden from the CPU tests)")


@functools.cache
def cuda_device_count() -> int:
    """The GPUs PyTorch sees on this machine, asked in a child process: querying CUDA here would fix this process's
    view of the GPUs before a test could set CUDA_VISIBLE_DEVICES."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" or v}  # the machine's own view
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.SubprocessError):
        return 0
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip().isdigit() else 0


def needs_gpus(n: int) -> None:
    """Skip the calling gpu test unless at least ``n`` GPUs exist."""
    if cuda_device_count() < n:
        pytest.skip(f"needs {n} GPUs, {cuda_device_count()} visible")


def pytest_collection_modifyitems(config, items):
    marked = [(item, {m.name for m in item.iter_markers()}) for item in items]
    unmarked = [item.nodeid for item, names in marked if "distributed" in names and "slow" not in names]
    if unmarked:  # the fast tier (-m "not slow") must never start a multi-process job
        raise pytest.UsageError(f"a distributed test must also be marked slow: {', '.join(unmarked)}")
    if not any("gpu" in item.keywords for item in items) or cuda_device_count():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_in_session(cmd: list[str], timeout: float, cwd: Path | None = None, env: dict | None = None):
    """Run ``cmd`` in its own session; kill its whole group (workers too) and fail if it outlives ``timeout``.
    The result carries ``seconds``, its wall time."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    result.seconds = time.monotonic() - start  # type: ignore[attr-defined]
    return result


def run_cli(
    args: list[str], cwd: Path, timeout: float = 120, env: dict | None = None, prefix: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m ignite_mgpu ARGS` in its own session; kill the whole group if it outlives `timeout`.
    ``prefix``: a command that runs it (``tests/slow_link.py``'s namespace)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(var, None)
    return run_in_session([*(prefix or []), sys.executable, "-m", "ignite_mgpu", *args], timeout, cwd, full_env)


def run_fresh(target: str, *args: str, timeout: float = 240) -> Any:
    """``module:function(*args)`` called in a fresh interpreter, its JSON-able result returned (with ``stderr``): no
    CUDA context and no process group in this pytest process, where an earlier test's CUDA would make a later
    ``launch(gpus=...)`` refuse. Fails with the child's output when it does."""
    module, name = target.split(":")
    code = f"import json, sys; from {module} import {name}; print(json.dumps({name}(*sys.argv[1:])))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = run_in_session([sys.executable, "-c", code, *args], timeout, REPO, env)
    assert out.returncode == 0, f"{target} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


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


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory):
    """An empty MLflow SQLite store (``mlflow.db``), made once per session and copied by the tests that use one:
    creating the tables of a new store takes seconds. Skips without the mlflow extra."""
    mlflow = pytest.importorskip("mlflow", reason="the mlflow extra (pip install -e '.[mlflow]') is not installed")
    pytest.importorskip("sqlalchemy", reason="MLflow's SQLite store needs sqlalchemy (the mlflow extra)")
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path
