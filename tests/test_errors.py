"""The error types and the one exit-code table. `python -m pytest tests/test_errors.py`."""

import signal

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


def test_exit_codes():
    assert exit_codes_text().startswith("0 success, 1 a rank failed (or the checkpoint named by --resume is corrupt)")
    assert set(EXIT_CODES) == {0, 1, 2, 3, 4, 5, 130, 138, 143}
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
