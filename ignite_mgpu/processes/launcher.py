"""Running a job: ``launch(fn, ...)`` for Python code, ``run_plan`` for a decided plan (``plan.make_plan``). The
supervisor spawns one worker per process and runs ``fn(local_rank, *args)`` inside ``idist.Parallel`` there; a job of
one process, or one that torchrun or SLURM started, runs in this process and joins their group.

Exit codes: errors.EXIT_CODES.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ignite_mgpu.config import BACKENDS, CPU_BINDINGS, STRATEGIES, DistConfig
from ignite_mgpu.errors import FAILED, SUCCESS, ConfigError, TrainingStopped, is_user_error, signal_exit_code
from ignite_mgpu.processes import cluster
from ignite_mgpu.processes.binding import apply_binding
from ignite_mgpu.processes.plan import LaunchPlan, Restart, make_plan
from ignite_mgpu.processes.supervisor import Supervisor
from ignite_mgpu.processes.worker import in_process_signals, run_in_group


def run_plan(
    plan: LaunchPlan, fn: Callable[..., Any], *args: Any, restart: Callable[[int], Restart] | None = None
) -> int:
    """Run ``fn(local_rank, *args)`` as the plan says; returns the job's exit code (errors.EXIT_CODES).

    ``restart(k)`` gives the arguments of restart k (``plan.max_restarts``; without it ``fn`` runs again with
    ``args``). After a stop on the pre-emption signal, global rank 0 requeues the SLURM job. The plan's GPU
    claims are released when the job ends.
    """
    with plan.claims:
        return _run(plan, fn, args, restart)


def _run(plan: LaunchPlan, fn: Callable[..., Any], args: tuple, restart: Callable[[int], Restart] | None) -> int:
    for line in plan.messages:
        print(f"ignite-mgpu: {line}", file=sys.stderr)
    first = cluster.is_first_process()
    if plan.binding.reason and first:  # once per job
        print(f"ignite-mgpu: {plan.binding.reason}", file=sys.stderr)
    if plan.external or (plan.backend is None and not plan.spawn_one):
        code = _run_here(plan, fn, args)
    else:
        code = Supervisor(plan, fn, args, restart).run()
        first = plan.node_rank == 0
    if plan.preempt_signal and code == signal_exit_code(plan.preempt_signal) and first:
        print(f"ignite-mgpu: {cluster.requeue()}", file=sys.stderr, flush=True)
    return code


def _run_here(plan: LaunchPlan, fn: Callable[..., Any], args: tuple) -> int:
    """One process of the job in this process: a one-process job, or one that torchrun / srun started."""
    unbind = apply_binding(plan.binding.rank(cluster.local_rank()))  # restored after the job
    with in_process_signals(plan.preempt_signal):
        try:
            run_in_group(plan, fn, args)
        except TrainingStopped as err:
            print(f"ignite-mgpu: {err}", file=sys.stderr)
            return err.exit_code
        except Exception as err:
            if not is_user_error(err):
                raise
            print(f"ignite-mgpu: {type(err).__name__}: {err}", file=sys.stderr)
            return FAILED
        finally:
            unbind()
    return SUCCESS


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
) -> None:
    """Run ``fn(local_rank, *args)`` in ``nproc`` processes per node inside ``ignite.distributed.Parallel``.

    ``backend="auto"`` is nccl with CUDA, else gloo; ``nproc`` defaults to the selected GPUs, or 1 on the CPU.
    Under torchrun / SLURM it spawns nothing and joins the group. On one node without ``master_port`` the
    rendezvous is a private file store (no TCP port, so two jobs never collide). ``gpus`` takes physical ids
    ("2,3"), "all", "none", "auto" or "auto:N". ``cpu_binding`` (auto, none, cores, numa) binds each process to its
    CPUs and sets its intra-op threads (README: the --cpu-binding flag). ``max_restarts``: after a failure a
    restart can cure (a crash, a killed rank, a collective timeout), every process is stopped and ``fn`` runs again
    from its start, up to that many times; the job must resume from its own checkpoints. The GPUs are claimed for
    the job's life (another job cannot take them); ``share=True`` runs beside other jobs' claims, ``wait`` waits up
    to that many seconds (``math.inf``: no limit) until the GPUs are free.

    Raises:
        ConfigError: an impossible request (bad nproc, nccl without GPUs, busy master_port, GPUs claimed by another
            job; ``errors.WaitTimedOut`` when ``wait`` ran out), before spawning.
        SystemExit: with the job's exit code when a rank failed (1), the loss diverged (3) or on SIGINT/SIGTERM
            (130/143); the failing rank's error has been printed once.
    """
    from ignite_mgpu.config import Config, validate

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
    code = run_plan(make_plan(dist_cfg), fn, *args)
    if code:
        raise SystemExit(code)


def _check_choices(**given: tuple[str, tuple[str, ...]]) -> None:
    for name, (value, choices) in given.items():
        if value not in choices:
            raise ConfigError(f"{name}={value!r}: use {', '.join(choices)}.")
