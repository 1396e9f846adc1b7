"""Inside one worker process: its process group and death signal, its CPU binding, its signal handlers, joining the
job's process group through ``idist.Parallel``, and the error file the supervisor reads when the worker fails.

Torch-free at import (ignite is imported once the worker runs), like the rest of the process layer.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ignite_mgpu.errors import FAILED, TrainingStopped, is_user_error
from ignite_mgpu.processes import cluster, stop
from ignite_mgpu.processes.binding import apply_binding, current, free_group_threads, thread_ids

if TYPE_CHECKING:
    from ignite_mgpu.processes.plan import LaunchPlan


def run_in_group(plan: LaunchPlan, fn: Callable[..., Any], args: tuple) -> None:
    """Join the job's process group (or none, for one process) and run ``fn(local_rank, *args)`` in it."""
    import ignite.distributed as idist

    stop.set_collective_timeout(plan.timeout)
    for name in ("launcher.Parallel", "auto.auto_dataloader", "auto.auto_model", "auto.auto_optim"):
        logging.getLogger(f"ignite.distributed.{name}").setLevel(logging.WARNING)  # ignite keeps existing loggers
    before_group = thread_ids()
    own_group = plan.external and plan.backend is not None and _join_torchrun_attempt(plan.backend)
    try:
        with idist.Parallel(backend=None if own_group else plan.backend, init_method=plan.init_method) as parallel:
            free_group_threads(before_group)  # cores: gloo's threads communicate on the job's CPUs
            _say_where(plan)
            parallel.run(fn, *args)
            if idist.get_world_size() > 1:
                # A gloo thread releases the last collective's tensors a moment after wait() returned, and needs
                # the GIL for it. A process that exits normally (started by torchrun or srun) can reach interpreter
                # shutdown first; the thread then dies there ("terminate called without an active exception",
                # SIGABRT) and a finished job counts as failed. Waiting here releases the GIL until every rank is
                # done, so those threads finish first. (Spawned workers skip the shutdown with os._exit.)
                idist.barrier()
    finally:
        if own_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _join_torchrun_attempt(backend: str) -> bool:
    """Under torchrun, join the process group through this restart's own namespace of the agent's store.

    torchrun keeps one store for the whole job, and the env:// rendezvous adds no per-restart prefix: processes
    it restarted would read the previous processes' addresses (gloo: "connectFullMesh failed ... Connection
    refused"). ignite then takes the group as it finds it. False when torchrun did not start this process.
    """
    agent_store = cluster.torchrun_store()
    if agent_store is None:
        return False
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(cluster.local_rank())  # as ignite does when it creates the group
    host, port, restart = agent_store
    store = dist.PrefixStore(f"ignite_mgpu/restart{restart}/", dist.TCPStore(host, port, is_master=False))
    world_size, _ = cluster.job_size()
    dist.init_process_group(backend, store=store, rank=cluster.global_rank(), world_size=world_size)
    return True


def _say_where(plan: LaunchPlan) -> None:
    """Each rank's first line: the CPUs it is bound to, the physical GPU it drives (when either was chosen)."""
    import ignite.distributed as idist

    bound = current()
    first_line = [bound.describe() if bound is not None else ""]
    if plan.gpus is not None and idist.device().type == "cuda":
        import torch

        index = idist.device().index or 0
        first_line.append(f"cuda:{index} is physical GPU {plan.gpus[index]} ({torch.cuda.get_device_name(index)})")
    if any(first_line):  # each rank says once where it runs
        print(f"rank {idist.get_rank()}: {'; '.join(p for p in first_line if p)}", file=sys.stderr, flush=True)


def _on_signal(signum: int, frame: Any) -> None:
    if signum == signal.SIGINT and stop.stop_requested():
        raise KeyboardInterrupt  # second Ctrl-C: stop at once
    stop.request_stop(signum)


@contextlib.contextmanager
def in_process_signals(preempt_signal: int | None = None) -> Iterator[None]:
    """SIGINT/SIGTERM (and the pre-emption signal) ask the training in this process to stop at the next guard
    check (one-process jobs, and every process that torchrun or srun started)."""
    handled = [signal.SIGINT, signal.SIGTERM, *([preempt_signal] if preempt_signal else [])]
    old = {s: signal.signal(s, _on_signal) for s in handled}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _set_pdeathsig() -> None:
    # If the launcher dies (even by SIGKILL), its workers die too instead of holding GPUs and ports.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def failure_record(rank: int, err: BaseException) -> dict[str, Any]:
    """What a failed worker tells the supervisor in its failure file: its rank, when, the error, its exit code."""
    return {
        "rank": rank,
        "time": time.time(),
        "type": type(err).__name__,
        "message": str(err),
        "traceback": getattr(err, "detail", "") if is_user_error(err) else traceback.format_exc(),
        "code": err.exit_code if isinstance(err, TrainingStopped) else FAILED,
        "user_error": is_user_error(err),  # a restart would meet it again
    }


def worker_main(local_rank: int, plan: LaunchPlan, fn: Callable[..., Any], args: tuple, error_dir: str) -> None:
    """The spawned process's entry: set up the process, run ``fn``, exit with its code (an error file on failure)."""
    _set_pdeathsig()
    os.setpgid(0, 0)  # own process group: Ctrl-C reaches only the launcher, which then stops the workers
    for var in cluster.slurm_task_variables():
        del os.environ[var]  # inside an allocation ignite would read the launcher's SLURM task, not this rank
    rank = plan.node_rank * plan.nproc + local_rank
    os.environ.update(plan.env)
    # Before anything imports torch here (unless unpickling the job function already did: then it resizes the pool).
    apply_binding(plan.binding.rank(local_rank))
    os.environ.update(
        cluster.worker_environment(
            rank, local_rank, plan.world_size, plan.nproc, plan.node_rank, plan.master_addr, plan.master_port or 29500
        )
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_signal)
    if plan.preempt_signal:  # SLURM signals every process of the step, the workers too: the same stop
        signal.signal(plan.preempt_signal, _on_signal)
    stop.set_status_file(Path(error_dir, f"status{rank}"))  # how far it got, and whether it is saving
    code = 0
    try:
        run_in_group(plan, fn, args)
    except BaseException as err:  # every failure becomes a failure file and an exit code
        record = failure_record(rank, err)
        code = record["code"]
        Path(error_dir, f"rank{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a broken process group must not hang the exit
