"""The error types and the one exit-code table; the process layer stays free of torch, ignite and the training
code, and the package has no import cycle. `python -m pytest tests/test_errors.py`."""

import ast
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ignite_mgpu import errors
from ignite_mgpu.errors import (
    EXIT_CODES,
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    TrainingDiverged,
    TrainingInterrupted,
    TrainingStopped,
    exit_codes_text,
    is_user_error,
)

PACKAGE = Path(errors.__file__).parent


def test_exit_codes():
    assert exit_codes_text().startswith("0 success, 1 a rank failed (or the checkpoint named by --resume is corrupt)")
    assert set(EXIT_CODES) == {0, 1, 2, 3, 130, 138, 143}
    assert TrainingInterrupted(signal.SIGINT, 7).exit_code == 130
    stopped = TrainingInterrupted(signal.SIGTERM, 7)
    assert stopped.exit_code == 143 and str(stopped).startswith("stopped by SIGTERM at iteration 7")
    assert TrainingDiverged("x").exit_code == 3 and TrainingStopped("x").exit_code == 1
    assert ConfigError("x").exit_code == 2 and CheckpointError("x").exit_code == 2
    assert CorruptCheckpointError("x").exit_code == 1


def test_user_errors_are_reported_without_a_traceback():
    for err in (ConfigError("x"), CheckpointError("x"), TrainingDiverged("x")):
        assert is_user_error(err)
    assert not is_user_error(RuntimeError("boom"))
    assert isinstance(ConfigError("x"), ValueError)  # public API: ConfigError was always a ValueError


@pytest.mark.timeout(60)
def test_the_process_layer_imports_neither_torch_nor_ignite():
    check = (
        "import sys, ignite_mgpu.errors, ignite_mgpu.launcher, ignite_mgpu.supervisor, ignite_mgpu.worker, "
        "ignite_mgpu.binding, ignite_mgpu.config, ignite_mgpu.stop, ignite_mgpu.scheduler, ignite_mgpu.cli, "
        "ignite_mgpu.jobs, ignite_mgpu.preflight; "
        "loaded = sorted(m for m in ('torch', 'ignite') if m in sys.modules); "
        "training = sorted(m for m in sys.modules if m.startswith('ignite_mgpu.') and m.split('.')[1] in "
        "('train', 'engine', 'guard', 'report', 'strategy', 'data', 'checkpoint')); print(loaded, training)"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []"


def module_imports() -> dict[str, set[str]]:
    """Every ignite_mgpu module -> the ignite_mgpu modules it imports at module level (not inside functions, not
    under TYPE_CHECKING): the imports that run when it is imported."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("ignite_mgpu", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        found: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ignite_mgpu"):
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("ignite_mgpu")}
        graph[name] = found
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycle():
    graph = module_imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            pytest.fail(f"import cycle: {' -> '.join([*path[path.index(module) :], module])}")
        if module in done:
            return
        for dep in graph[module]:
            visit(dep, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])
    assert "ignite_mgpu.errors" in graph and not graph["ignite_mgpu.errors"]  # a leaf


def test_the_process_layer_never_imports_the_training_layer():
    graph = module_imports()
    training = {"train", "engine", "guard", "report", "strategy", "data", "models", "optim", "checkpoint"}
    process_layer = ("launcher", "supervisor", "worker", "binding", "stop", "errors", "config", "cli", "gpus")
    for module in (*process_layer, "scheduler", "jobs", "preflight"):
        deps = {d.split(".")[1] for d in graph[f"ignite_mgpu.{module}"] if d != "ignite_mgpu"}
        assert not deps & training, (module, deps & training)
