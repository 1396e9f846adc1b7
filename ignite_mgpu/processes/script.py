"""``ignite-mgpu run``: any training script (or ``-m module``) in N processes with the environment torchrun gives
them, under the supervisor: GPUs chosen by physical id, one report per failure, nothing left running, restarts.
The script creates its own process group (``init_process_group()``, ``idist.Parallel``, ``launch()``).

Torch-free: the script imports what it needs, in the workers.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import runpy
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.schema import Config, DistConfig
from ignite_mgpu.env import cluster
from ignite_mgpu.errors import USAGE, ConfigError, ScriptArgumentsError
from ignite_mgpu.processes import launcher
from ignite_mgpu.processes.job import Job, Restart
from ignite_mgpu.processes.plan import make_plan


def run_script_job(
    cfg: DistConfig, target: str, script_args: list[str], module: bool = False, environ: Mapping[str, str] = os.environ
) -> int:
    """Run ``target`` (a script's path, or a module's name with ``module``) with ``script_args`` in the processes
    ``cfg`` asks for; returns the job's exit code (errors.EXIT_CODES).

    Raises:
        ConfigError: under torchrun or srun, a script or module that does not exist, an impossible request.
    """
    check_not_nested(environ)
    check_target(target, module)
    validate(Config(dist=cfg))
    plan, claims = make_plan(cfg, os.environ, join_group=False)
    job = Job(run_script, (target, script_args, module))
    # For the restart's message; TORCHELASTIC_RESTART_COUNT counts.
    again = Restart(job.args, resumes=False, name=target)
    with claims:
        return launcher.run_job(plan, job, claims, restart=lambda restarts: again).outcome.code


def check_not_nested(environ: Mapping[str, str]) -> None:
    if cluster.started_externally(environ):
        raise ConfigError(
            "ignite-mgpu run was started by torchrun or srun (RANK, WORLD_SIZE and LOCAL_RANK are set, or this is "
            "a SLURM step of several tasks), which already started the processes: each of them would start its own "
            "set of processes. Use one launcher: run the script itself under torchrun or srun, or start ignite-mgpu "
            "run from the shell or the batch script (once per node, with --nnodes and --node-rank), not under "
            "another launcher."
        )


def check_target(target: str, module: bool) -> None:
    """The script exists (or the module can be found), checked once here rather than failing on every rank."""
    if module:
        # Where python -m looks first (the ignite-mgpu command does not)
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise ConfigError(
                f"-m {target}: no module named {target!r} can be imported from {os.getcwd()} (sys.path). Check the "
                "name (dots, no .py) and that its package is installed or in this folder."
            )
    elif not Path(target).is_file():
        raise ConfigError(
            f"{target}: no such script. Give the path of a Python file: ignite-mgpu run [OPTIONS] SCRIPT.py [ARGS], "
            "or -m MODULE for a module."
        )


def run_script(local_rank: int, target: str, argv: list[str], module: bool) -> None:
    """In a worker: run the script as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would, as ``__main__``.

    Raises:
        ScriptArgumentsError: the script exited with code 2 (argparse's and click's code for bad arguments).
        RuntimeError: it exited with another non-zero code; its own errors pass through.
    """
    if cluster.global_rank() != 0:
        _quiet_argparse()
    sys.argv = [target, *argv]
    try:
        if module:
            sys.path.insert(0, os.getcwd())  # as python -m does
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.realpath(target)))  # as python SCRIPT does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as err:
        failure = _exited(target, err)
        if failure is not None:
            # Where the script called sys.exit.
            failure.__traceback__ = _script_frames(err.__traceback__)
            raise failure from None
    except BaseException as err:
        err.__traceback__ = _script_frames(err.__traceback__)
        raise
    finally:
        # A worker ends with os._exit, which runs no atexit handler; a script (its loggers, trackers) may rely on
        # them, as it would when started by python or torchrun. Private: no public call runs them all.
        atexit._run_exitfuncs()


def _exited(target: str, err: SystemExit) -> Exception | None:
    """What ``sys.exit(code)`` in the script means for the job: nothing (0, None), bad arguments (2), a failure."""
    code, name = err.code, os.path.basename(target)
    if code is None or code == 0:
        return None
    if code == USAGE:
        return ScriptArgumentsError(
            f"{name} rejected its arguments: it exited with code 2, as argparse and click do after printing its "
            f"usage (above). Fix the arguments after the script's name (ignite-mgpu run [OPTIONS] {name} [ARGS]; "
            f"{name} --help lists them)."
        )
    said = f"exited with code {code}" if isinstance(code, int) else f"exited with the message {str(code)!r}"
    return RuntimeError(f"{name} {said} (sys.exit)")


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on: this module's and runpy's frames say nothing to its
    author."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return tb


def _quiet_argparse() -> None:
    """Every rank parses the same arguments: the usage, its errors, --help and --version are printed once, by rank 0
    (argparse prints all of them through one private method)."""
    import argparse

    setattr(argparse.ArgumentParser, "_print_message", lambda self, message, file=None: None)  # noqa: B010
