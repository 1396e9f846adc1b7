"""Running a job: ``launch(fn, ...)`` for Python code, ``run_job`` for a decided plan (``plan.make_plan``). The
supervisor starts one worker per process (forked by the fork server; from a notebook, forked from it) and runs the
job there inside ``idist.Parallel``; a job of one process, or one that torchrun or SLURM started, runs in this
process and joins their group.

Exit codes: errors.EXIT_CODES.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.schema import BACKENDS, CPU_BINDINGS, STRATEGIES, Config, DistConfig
from ignite_mgpu.cpus.affinity import apply_binding
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
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.processes import notebook
from ignite_mgpu.processes.attempt import Ended
from ignite_mgpu.processes.job import Job, Restart
from ignite_mgpu.processes.outcome import Outcome
from ignite_mgpu.processes.plan import LaunchPlan, make_plan
from ignite_mgpu.processes.supervisor import Supervisor
from ignite_mgpu.processes.worker import in_process_signals, run_in_group

_GPU_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")  # what make_plan exports for gpus=


def in_workers(plan: LaunchPlan) -> bool:
    """Whether the job runs in workers of this process (else in this process itself)."""
    return not plan.external and (plan.backend is not None or plan.spawn_one)


def run_job(
    plan: LaunchPlan,
    job: Job,
    claims: GpuClaims | None = None,
    restart: Callable[[int], Restart] | None = None,
    report: bool = True,
    run_dir: str | None = None,
) -> Ended:
    """Run ``job`` as ``plan`` says; returns how it ended (its exit code is ``.outcome.code``, errors.EXIT_CODES) and
    what its function returned on global rank 0 (``.value``; None where it failed or returned nothing).

    ``claims``: the job's GPU claims, which an elastic job changes (the caller holds and releases them).
    ``restart(k)`` gives the arguments of restart k (``plan.max_restarts``; without it the job runs again with its
    arguments). ``report=False``: how the job ended is left to the caller, not printed. ``run_dir``: where a hang's
    report goes. After a stop on the pre-emption signal, global rank 0 requeues the SLURM job.
    """
    for line in plan.messages:
        print(f"ignite-mgpu: {line}", file=sys.stderr)
    first = cluster.is_first_process()
    if plan.binding.reason and first:  # once per job
        print(f"ignite-mgpu: {plan.binding.reason}", file=sys.stderr)
    if in_workers(plan):
        supervisor = Supervisor(plan, job, claims, restart, report, run_dir)
        supervisor.run()
        ended = supervisor.ended
        # "gave up after 1 restart(s)": the caller's message says it too.
        if supervisor.note and not report:
            advice = " ".join(filter(None, [ended.outcome.advice, supervisor.note]))
            ended = dataclasses.replace(ended, outcome=dataclasses.replace(ended.outcome, advice=advice))
        first = plan.node_rank == 0
    else:
        ended = _in_this_process(plan, job, report)
    if plan.preempt_signal and ended.outcome.code == signal_exit_code(plan.preempt_signal) and first:
        print(f"ignite-mgpu: {cluster.requeue(script=not plan.join_group)}", file=sys.stderr, flush=True)
    return ended


def _in_this_process(plan: LaunchPlan, job: Job, report: bool = True) -> Ended:
    """One process of the job in this process: a one-process job, or one that torchrun / srun started."""
    unbind = apply_binding(plan.binding.rank(cluster.local_rank()))  # restored after the job
    clock.set_clock(clock.first_attempt())  # goodput's anchors: the command's start
    with in_process_signals(plan.preempt_signal):
        try:
            value = run_in_group(plan, job)
        except TrainingStopped as err:
            ended = Outcome(err.exit_code, str(err))
        except Exception as err:
            if not is_user_error(err):
                raise
            ended = Outcome(FAILED, f"{type(err).__name__}: {err}", rank=cluster.global_rank())
        else:
            return Ended(Outcome(SUCCESS), value=value)
        finally:
            unbind()
            clock.set_clock(None)
    if report:
        print(f"ignite-mgpu: {ended.cause}", file=sys.stderr)
    return Ended(ended)


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


def launch(
    fn: Callable[..., Any] | str,
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
    rank_prefix: bool = False,
) -> Any:
    """Run ``fn(local_rank, *args)`` in ``nproc`` processes per node inside ``ignite.distributed.Parallel``; returns
    what ``fn`` returned on global rank 0 (pickled, tensors on the CPU). ``fn`` may be a "package.module:function".

    ``backend="auto"``: nccl with CUDA, else gloo; ``nproc``: the selected GPUs, or 1 on the CPU. Under torchrun /
    SLURM it spawns nothing and joins the group. On one node without ``master_port`` the rendezvous is a private
    file store (no port, two jobs never collide). ``gpus``: physical ids ("2,3"), "all", "none", "auto", "auto:N".
    ``cpu_binding`` (auto, none, cores, numa): each process's CPUs and intra-op threads. ``max_restarts``: after a
    curable failure (a crash, a killed rank, a collective timeout) every process stops and ``fn`` runs again from
    its start, up to that many times (resuming from its own checkpoints). The GPUs are claimed for the job's life;
    ``share=True`` runs beside other jobs' claims, ``wait`` waits that many seconds (``math.inf``: no limit) for
    them. The workers' lines reach stdout and stderr whole; ``rank_prefix`` begins each with its rank. From a
    notebook (``fn`` defined in a cell) the workers are forked: call launch() before anything touches CUDA there.

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
        rank_prefix=rank_prefix,
    )
    validate(Config(dist=dist_cfg))
    return _run_and_end(dist_cfg, Job(fn, args))


def _run_and_end(dist_cfg: DistConfig, job: Job) -> Any:
    """launch() once its arguments are checked: fork or spawn, run, and end as a script or a notebook expects."""
    if isinstance(job.fn, str):
        _check_named(job.fn)
    method = notebook.start_method(job.fn, job.args)
    with _gpus_restored(), notebook.fork_safe_cuda_queries(method == "fork"):
        plan, claims = make_plan(dist_cfg)
        with claims:  # the GPUs, held while the job runs
            if method == "fork":  # else the plan's: the fork server
                plan = dataclasses.replace(plan, start_method=method)
                if in_workers(plan):
                    notebook.check_fork_safe(plan.device)
            interactive = notebook.interactive()
            result = run_job(plan, job, claims, report=not interactive)
    ended = result.outcome
    if ended.code == SUCCESS:
        return result.value
    if interactive:
        raise JobFailed(ended.message(), ended.code, ended.rank, ended.details)
    raise SystemExit(ended.code)


def _check_named(fn: str) -> None:
    """A function named for the workers to import: "package.module:function", its module found from here."""
    module, _, name = fn.partition(":")
    try:
        found = bool(module and name.isidentifier()) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(
            f"launch({fn!r}): a function named for the workers is written 'package.module:function', and its "
            "module must be importable here (sys.path); pass the function itself, or fix the name."
        )


def _check_choices(**given: tuple[str, tuple[str, ...]]) -> None:
    for name, (value, choices) in given.items():
        if value not in choices:
            raise ConfigError(f"{name}={value!r}: use {', '.join(choices)}.")
