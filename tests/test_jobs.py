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
