"""The fault tests' one fixture: ``h``, a Harness in the test's own folder that checks nothing outlives its jobs."""

from pathlib import Path

import pytest

from tests.faults.harness import Harness


@pytest.fixture
def h(tmp_path: Path):
    harness = Harness(tmp_path)
    yield harness
    harness.cleanup()
