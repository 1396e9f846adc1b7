"""What ``fit`` returns: the exit code as an int (scripts keep ``sys.exit(fit(cfg))``), with the run's folder, its
last epoch's metrics and its best model. A real fit from a notebook kernel is in tests/distributed/test_notebooks.py.
`python -m pytest tests/test_jobs.py`."""

import subprocess
import sys

from ignite_mgpu.config.schema import Config, DistConfig
from ignite_mgpu.jobs import FitResult, fit
from tests.conftest import REPO


def test_the_result_is_the_exit_code():
    result = FitResult(3, None, {"epoch": 2})
    assert result == 3 and result.exit_code == 3 and isinstance(result, int) and f"{result}" == "3"
    assert not FitResult(0) and FitResult(0).metrics == {} and FitResult(0).best_model is None
    assert repr(result) == "FitResult(exit_code=3, output_dir=None, best_model=None, metrics={'epoch': 2})"
    code = "import sys; from ignite_mgpu.jobs import FitResult; sys.exit(FitResult(3))"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 3


def test_a_refused_config_returns_2_with_nothing_written(capsys):
    result = fit(Config(dist=DistConfig(nproc=0)))
    assert result == 2 and isinstance(result, FitResult) and result.output_dir is None and result.metrics == {}
    assert "dist.nproc" in capsys.readouterr().err


def test_a_torch_without_the_memory_trackers_is_told_to_upgrade_for_the_plan(monkeypatch, capsys):
    """torch 2.4 has no torch.distributed._tools.fsdp2_mem_tracker: `plan` says so in one paragraph, exit 2 (the
    rest of the package does not import the memory plan)."""
    import sys

    from ignite_mgpu.config.loading import load_config
    from ignite_mgpu.jobs import plan_memory

    for name in [n for n in sys.modules if n.startswith("ignite_mgpu.memory")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.fsdp2_mem_tracker", None)  # "not installed"
    assert plan_memory(load_config(overrides=["model.name=mlp"])) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "PyTorch's memory trackers (torch.distributed._tools.fsdp2_mem_tracker), which torch" in said
    assert "Upgrade torch to plan" in said
