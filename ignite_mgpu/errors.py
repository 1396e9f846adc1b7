"""The error types, the stop exceptions and the one exit-code table. Torch-free: the CLI and the process layer
(launcher, supervisor) import this module, never the training code."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

# The job's exit codes; the CLI's --help, the README and the supervisor quote this table.
EXIT_CODES = {
    0: "success",
    1: "a rank failed (or the checkpoint named by --resume is corrupt)",
    2: "usage or config error, found before anything started",
    3: "training diverged (non-finite loss)",
    4: "--wait ran out before the GPUs were free (nothing started)",
    5: "plan: nothing fits the memory, not even one sample per process (the table shows what each strategy needs)",
    130: "SIGINT (Ctrl-C)",
    138: "SIGUSR1, pre-emption (dist.preempt_signal, run --preempt-signal; 128 + its number): stopped (train: "
    "checkpointed), SLURM job requeued",
    143: "SIGTERM",
}
SUCCESS, FAILED, USAGE, DIVERGED, WAIT_TIMEOUT, NOTHING_FITS = 0, 1, 2, 3, 4, 5


def exit_codes_text() -> str:
    """The table as one line: "0 success, 1 a rank failed, ..."."""
    return ", ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items())


def signal_exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + N (SIGINT 130, SIGTERM 143)."""
    return 128 + signum


class ConfigError(ValueError):
    """A user mistake found before any process starts; printed as one paragraph, exit code 2. ``detail`` (e.g. the
    traceback of the user's own code that raised) is printed before the paragraph."""

    exit_code = USAGE

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class WaitTimedOut(ConfigError):
    """``--wait`` ran out before the GPUs were free: as with a refused config nothing started, one paragraph."""

    exit_code = WAIT_TIMEOUT


class WaitInterrupted(ConfigError):
    """Ctrl-C (or SIGTERM: ``signum``) while ``--wait`` waited for GPUs: nothing started and nothing is claimed; one
    paragraph, exit 130 (143) as for any Ctrl-C (SIGTERM), not click's "Aborted!" and 1, nor a silent end."""

    exit_code = signal_exit_code(signal.SIGINT)

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.exit_code = signal_exit_code(signum)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, unsafe, or from a different model (exit code 2 before
    the job starts; inside a running job the rank fails with it, exit code 1)."""

    exit_code = USAGE


class CorruptCheckpointError(CheckpointError):
    """The checkpoint named by ``--resume PATH`` is truncated or damaged: the data failed, not the command."""

    exit_code = FAILED


class ConfigErrors(ConfigError):
    """Several mistakes found by checks that ran one after another (``Checks``): every one reported at once, each
    its own numbered paragraph, in the order checked (exit code 2)."""

    def __init__(self, errors: list[ConfigError | CheckpointError]) -> None:
        listed = "\n".join(f"  {n}. {err}" for n, err in enumerate(errors, 1))
        super().__init__(f"{len(errors)} problems, in the order checked:\n{listed}")
        self.detail = "\n".join(d for err in errors if (d := getattr(err, "detail", "")))
        self.errors = errors


class Checks:
    """Runs checks that do not depend on each other and keeps each one's usage error (exit code 2), so that a
    user sees every mistake at once: a mistyped data.name is not hidden behind the output folder's problem. Other
    errors (a corrupt checkpoint: exit 1) pass at once.

        checks = Checks()
        with checks.one():
            check_model(cfg)
        with checks.one():
            check_output_dir(cfg)
        checks.raise_found()
    """

    def __init__(self) -> None:
        self.found: list[ConfigError | CheckpointError] = []

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        try:
            yield
        except (ConfigError, CheckpointError) as err:
            if err.exit_code != USAGE:
                raise
            for each in err.errors if isinstance(err, ConfigErrors) else [err]:
                if str(each) not in map(str, self.found):  # the same mistake met by two checks: once
                    self.found.append(each)

    def raise_found(self) -> None:
        """Raise what was found: one error as it is, several as ``ConfigErrors``."""
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise ConfigErrors(self.found)


class TrainingStopped(RuntimeError):
    """Every rank stopped together on purpose; ``exit_code`` is what the process exits with."""

    exit_code = FAILED


class TrainingDiverged(TrainingStopped):
    """A non-finite loss on some rank: every rank stopped at the same iteration."""

    exit_code = DIVERGED


class TrainingInterrupted(TrainingStopped):
    """A stop signal (SIGTERM, Ctrl-C) reached some rank: every rank stopped at the same iteration."""

    def __init__(self, signum: int, iteration: int, then: str = "") -> None:
        name = signal.Signals(signum).name
        said = f"stopped by {name} at iteration {iteration}; every rank stopped at the same iteration"
        super().__init__(f"{said}; {then}" if then else said)  # then: the checkpoint written and how to go on
        self.exit_code, self.signum, self.iteration = signal_exit_code(signum), signum, iteration


class ScriptArgumentsError(ConfigError):
    """A script run by ``ignite-mgpu run`` rejected its own arguments: it exited with code 2, the code argparse and
    click exit with after printing the usage (exit code 2; a restart would meet the same arguments)."""


class JobFailed(RuntimeError):
    """A job launched from a notebook or an interactive session failed: raised by ``launch`` where a script gets
    ``SystemExit``. ``exit_code`` is the job's code (errors.EXIT_CODES), ``rank`` the global rank that failed first
    (None: not one rank's error), ``traceback`` that rank's traceback (text; also at the end of the message)."""

    def __init__(self, message: str, exit_code: int, rank: int | None = None, traceback: str = "") -> None:
        super().__init__(message)
        self.exit_code, self.rank, self.traceback = exit_code, rank, traceback


def is_user_error(err: BaseException) -> bool:
    """Errors whose message says it all (bad config or checkpoint, a deliberate stop): reported without a
    traceback."""
    return isinstance(err, (ConfigError, CheckpointError, TrainingStopped))
