"""The tutorials, followed as a reader does: from an empty folder, each file written as the page shows it, the
page's commands run there as written, with nothing of the repository at hand but the installed package (no
configs/, examples/ or tests/ to read or import). 2 gloo processes on the CPU, small data.

    python -m pytest tests/test_tutorials.py -q
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.docs_blocks import doc_block, installed_only, run_block, write_files
from tests.terminal import declared_only, in_terminal

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The installed package alone, for PYTHONPATH: set up once for every page followed here."""
    return installed_only(tmp_path_factory.mktemp("site"))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _closing(stderr: str) -> list[str]:
    """The end-of-run lines, without the log prefix."""
    return [line.split(" INFO ", 1)[1] for line in stderr.splitlines() if " INFO " in line]


def from_an_empty_folder(tmp_path, package, block, name: str, page: str) -> tuple[Path, list[Path]]:
    """The tutorial's first ``block`` (``doc_block``'s) run in an empty home folder, then its files written into
    the folder it made."""
    home = tmp_path / "home"
    home.mkdir()
    run_block(block, home, pythonpath=package)
    return home / name, write_files(page, home / name)


@pytest.mark.timeout(420)
def test_first_project_from_an_empty_folder(tmp_path, package):
    page = "tutorials/first-project.md"
    project, written = from_an_empty_folder(tmp_path, package, doc_block("first-project-folder"), "waves", page)
    files = ["config.yaml", "my_project/__init__.py", "my_project/data.py", "my_project/model.py"]
    assert sorted(p.relative_to(project).as_posix() for p in written) == files
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml", "my_project"]  # nothing else to lean on

    # Trained twice by the same command: each run in a folder of its own; then both compared.
    result = run_block(doc_block("first-project"), project, timeout=300, pythonpath=package)
    runs = sorted(p for p in (project / "runs").iterdir() if p.is_dir())
    assert len(runs) == 2, result.stderr[-3000:]
    assert metrics(runs[0])[-1]["val_accuracy"] > 0.8 and len(metrics(runs[1])) == 2
    closing = [line for line in _closing(result.stderr) if line.startswith(("finished:", "best model:", "next:"))]
    assert [line.split(":")[0] for line in closing] == ["finished", "best model", "next"] * 2, closing
    assert f"the run is in {runs[0].relative_to(project)}/" in closing[0]
    assert all(f"{run.name} (ddp, 2 processes, CPU): runs/{run.name}" in result.stdout for run in runs)  # the table
    assert (project / "report.png").is_file()  # several runs: one figure, in the current folder

    # Named, then continued from its checkpoint: one more epoch. In a terminal (the progress bar), as after the
    # README's install: only the declared dependencies can be imported.
    env = {**os.environ, **declared_only(tmp_path / "declared", package)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    code, shown = in_terminal(
        ["bash", "-euo", "pipefail", "-c", doc_block("first-project-resume").text], project, env, 300
    )
    assert code == 0, shown[-3000:]
    assert [row["epoch"] for row in metrics(project / "runs" / "waves")] == [1, 2, 3], shown[-3000:]
    assert "resumed from" in shown and "%|" in shown


@pytest.mark.timeout(420)
def test_from_dataparallel_from_an_empty_folder(tmp_path, package):
    import torch

    page = "tutorials/from-dataparallel.md"
    folder, written = from_an_empty_folder(tmp_path, package, doc_block("dp-folder"), "from-dp", page)
    assert sorted(p.name for p in written) == ["after.py", "before.py", "project.py", "train.yaml"]

    # The classic script: DataParallel (the CPU here), the loss computed in forward().
    before = run_block(doc_block("dp-before"), folder, pythonpath=package)
    assert float(before.stdout.split("epoch 3:")[1].split("val_accuracy")[1].split()[0]) > 0.9
    assert (folder / "runs" / "before" / "model.pt").is_file()

    # The CLI path, twice (each run in a folder of its own): train.loss: model.
    for _ in range(2):
        cli = run_block(doc_block("dp-cli"), folder, timeout=200, pythonpath=package)
        assert "the best model loads into the plain Net" in cli.stdout
    runs = sorted(p for p in (folder / "runs").iterdir() if p.name not in ("before", "after"))
    assert len(runs) == 2 and all(metrics(run)[-1]["val_loss"] < 0.1 for run in runs)
    assert [p.name.split("_val_")[1].split("=")[0] for p in runs[0].glob("best_model_*")] == ["loss"]

    # The Python path: create_trainer(loss_fn=None), create_evaluator(model_loss=True).
    after = run_block(doc_block("dp-python"), folder, pythonpath=package)
    lines = [line for line in after.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 3, after.stdout  # printed by rank 0 only
    assert float(lines[-1].split("val_loss")[1]) < 0.1

    spec = importlib.util.spec_from_file_location("readers_project", folder / "project.py")
    assert spec is not None and spec.loader is not None
    project = importlib.util.module_from_spec(spec)  # the reader's own module, as written from the page
    spec.loader.exec_module(project)
    project.Net().load_state_dict(torch.load(folder / "runs" / "after" / "model.pt", weights_only=True))  # no "module."
    assert not list(folder.glob("*.pt")) and not list(folder.parent.glob("*.pt"))  # nothing saved beside the scripts


@pytest.mark.timeout(240)
def test_the_python_path_example_runs_anywhere_and_again(tmp_path, package):
    """docs/how-to/python-api.md's fit() example: no config file of the repository, a folder of its own each run."""
    (tmp_path / "home").mkdir()
    for _ in range(2):
        result = run_block(doc_block("python-fit"), tmp_path / "home", pythonpath=package)
    runs = sorted((tmp_path / "home" / "runs").iterdir())
    assert len(runs) == 2 and all(len(metrics(run)) == 1 for run in runs)
    assert result.stdout.startswith(f"{runs[1].relative_to(tmp_path / 'home')} ") and "best_model_1_" in result.stdout
