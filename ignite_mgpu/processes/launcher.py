"""Running a job: ``launch(fn, ...)`` for Python code, ``run_job`` / ``run_plan`` for a decided plan
(``plan.make_plan``). The supervisor starts one worker per process (forked by the fork server; from a notebook,
forked from it) and runs ``fn(local_rank, *args)`` inside ``idist.Parallel`` there; a job of one process, or one
that torchrun or SLURM started, runs in this process and joins their group.

Exit codes: errors.EXIT_CODES.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.schema import BACKENDS, CPU_BINDINGS, STRATEGIES, Config, DistConfig
from ignite_mgpu.cpus.binding import apply_binding
from ignite_mgpu.env import clock, cluster
from ignite_mgpu.errors import (
    FAILED,
    SUCCESS,
    ConfigError,
    JobFailed,
    TrainingStopped,
    is_user_error,
    signal_exit_code,
)
from ignite_mgpu.processes import notebook
from ignite_mgpu.processes.outcome import Outcome
from ignite_mgpu.processes.plan import LaunchPlan, Restart, make_plan
from ignite_mgpu.processes.supervisor import Supervisor
from ignite_mgpu.processes.worker import in_process_signals, run_in_group

_GPU_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")  # what make_plan exports for gpus=


def run_plan(
    plan: LaunchPlan, fn: Callable[..., Any], *args: Any, restart: Callable[[int], Restart] | None = None
) -> int:
    """Run ``fn(local_rank, *args)`` as the plan says; returns the job's exit code (errors.EXIT_CODES).

    ``restart(k)`` gives the arguments of restart k (``plan.max_restarts``; without it ``fn`` runs again with
    ``args``). After a stop on the pre-emption signal, global rank 0 requeues the SLURM job. The plan's GPU
    claims are released when the job ends.
    """
    return run_job(plan, fn, *args, restart=restart)[0].code


def in_workers(plan: LaunchPlan) -> bool:
    """Whether the job runs in workers of this process (else in this process itself)."""
    return not plan.external and (plan.backend is not None or plan.spawn_one)


def run_job(
    plan: LaunchPlan,
    fn: Callable[..., Any],
    *args: Any,
    restart: Callable[[int], Restart] | None = None,
    report: bool = True,
) -> tuple[Outcome, Any]:
    """``run_plan``, returning how the job ended and what ``fn`` returned on global rank 0 (None where it failed
    or returned nothing). ``report=False``: how it ended is left to the caller, not printed. The plan's GPU claims
    are released when the job ends."""
    with plan.claims:
        return _run_job(plan, fn, args, restart, report)


def _run_job(
    plan: LaunchPlan, fn: Callable[..., Any], args: tuple, restart: Callable[[int], Restart] | None, report: bool
) -> tuple[Outcome, Any]:
    for line in plan.messages:
        print(f"ignite-mgpu: {line}", file=sys.stderr)
    first = cluster.is_first_process()
    if plan.binding.reason and first:  # once per job
        print(f"ignite-mgpu: {plan.binding.reason}", file=sys.stderr)
    if in_workers(plan):
        supervisor = Supervisor(plan, fn, args, restart, report)
        supervisor.run()
        ended, value = supervisor.outcome, supervisor.value
        # "gave up after 1 restart(s)": the caller's message says it too.
        if supervisor.note and not report:
            ended = dataclasses.replace(ended, advice=" ".join(filter(None, [ended.advice, supervisor.note])))
        first = plan.node_rank == 0
    else:
        ended, value = _run_here(plan, fn, args, report)
    if plan.preempt_signal and ended.code == signal_exit_code(plan.preempt_signal) and first:
        print(f"ignite-mgpu: {cluster.requeue(script=not plan.join_group)}", file=sys.stderr, flush=True)
    return ended, value


def _run_here(plan: LaunchPlan, fn: Callable[..., Any], args: tuple, report: bool = True) -> tuple[Outcome, Any]:
    """One process of the job in this process: a one-process job, or one that torchrun / srun started."""
    unbind = apply_binding(plan.binding.rank(cluster.local_rank()))  # restored after the job
    clock.set_clock(plan.clock)  # goodput's anchors: the command's start
    with in_process_signals(plan.preempt_signal):
        try:
            value = run_in_group(plan, fn, args)
        except TrainingStopped as err:
            ended = Outcome(err.exit_code, str(err))
        except Exception as err:
            if not is_user_error(err):
                raise
            ended = Outcome(FAILED, f"{type(err).__name__}: {err}", rank=cluster.global_rank())
        else:
            return Outcome(SUCCESS), value
        finally:
            unbind()
            clock.set_clock(None)
    if report:
        print(f"ignite-mgpu: {ended.cause}", file=sys.stderr)
    return ended, None


@contextlib.contextmanager
def _gpus_restored() -> Iterator[None]:
    """The GPU selection that the plan exports (``gpus=``) is the workers'; afterwards this process has its own
    back, so that a notebook can launch again on other GPUs (a job on chosen GPUs never runs in this process)."""
    saved = {var: os.environ.get(var) for var in _GPU_VARS}
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def run_named(local_rank: int, target: str, *args: Any) -> Any:
    """Import ``target`` ("module:function") and run it: passed to ``run_plan``, only the name is pickled, so the
    launching process spawns the workers without importing ignite or the training code (a second per start)."""
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(local_rank, *args)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int | None = None,
    backend: str = "auto",
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    gpus: str | None = None,
    strategy: str = "ddp",
    timeout: float = 300.0,
    cpu_binding: str = "none",
    max_restarts: int = 0,
    share: bool = False,
    wait: float | None = None,
) -> Any:
    """Run ``fn(local_rank, *args)`` in ``nproc`` processes per node inside ``ignite.distributed.Parallel``; returns
    what ``fn`` returned on global rank 0 (None where it returned nothing; pickled, tensors moved to the CPU).

    ``backend="auto"`` is nccl with CUDA, else gloo; ``nproc`` defaults to the selected GPUs, or 1 on the CPU.
    Under torchrun / SLURM it spawns nothing and joins the group. On one node without ``master_port`` the
    rendezvous is a private file store (no TCP port, so two jobs never collide). ``gpus`` takes physical ids
    ("2,3"), "all", "none", "auto" or "auto:N". ``cpu_binding`` (auto, none, cores, numa) binds each process to its
    CPUs and sets its intra-op threads (README: the --cpu-binding flag). ``max_restarts``: after a failure a
    restart can cure (a crash, a killed rank, a collective timeout), every process is stopped and ``fn`` runs again
    from its start, up to that many times; the job must resume from its own checkpoints. The GPUs are claimed for
    the job's life (another job cannot take them); ``share=True`` runs beside other jobs' claims, ``wait`` waits up
    to that many seconds (``math.inf``: no limit) until the GPUs are free. From a notebook (``fn`` defined in a
    cell) the workers are forked: call launch() before anything touches CUDA there.

    Raises:
        ConfigError: an impossible request (bad nproc, nccl without GPUs, busy master_port, GPUs claimed by another
            job, from a notebook CUDA already used in the kernel; ``errors.WaitTimedOut`` when ``wait`` ran out,
            ``errors.WaitInterrupted`` on Ctrl-C while waiting), before spawning.
        SystemExit: from a script, with the job's exit code when a rank failed (1), the loss diverged (3) or on
            SIGINT/SIGTERM (130/143); the failing rank's error has been printed once.
        JobFailed: the same, from a notebook or an interactive session: the failing rank's error is its message.
    """
    notebook.leave_if_importing_main()
    choices = {"backend": (backend, BACKENDS), "strategy": (strategy, STRATEGIES)}
    _check_choices(**choices, cpu_binding=(cpu_binding, CPU_BINDINGS))
    dist_cfg = DistConfig(
        nproc=nproc,
        backend=backend,  # type: ignore[arg-type]  # checked against the Literal just above
        gpus=gpus,
        strategy=strategy,  # type: ignore[arg-type]  # checked against the Literal just above
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        timeout=timeout,
        cpu_binding=cpu_binding,  # type: ignore[arg-type]  # checked against the Literal just above
        max_restarts=max_restarts,
        share=share,
        wait=wait,
    )
    validate(Config(dist=dist_cfg))
    return _launch(dist_cfg, fn, args)


def _launch(dist_cfg: DistConfig, fn: Callable[..., Any], args: tuple) -> Any:
    """launch() once its arguments are checked: fork or spawn, run, and end as a script or a notebook expects."""
    method = notebook.start_method(fn, args)
    with _gpus_restored(), notebook.fork_safe_cuda_queries(method == "fork"):
        plan = make_plan(dist_cfg)
        if method == "fork":  # else the plan's: the fork server
            plan = dataclasses.replace(plan, start_method=method)
            if in_workers(plan):
                notebook.check_fork_safe(plan.device)
        interactive = notebook.interactive()
        ended, value = run_job(plan, fn, *args, report=not interactive)
    if ended.code == SUCCESS:
        return value
    if interactive:
        raise JobFailed(ended.message(), ended.code, ended.rank, ended.details)
    raise SystemExit(ended.code)


def _check_choices(**given: tuple[str, tuple[str, ...]]) -> None:
    for name, (value, choices) in given.items():
        if value not in choices:
            raise ConfigError(f"{name}={value!r}: use {', '.join(choices)}.")
