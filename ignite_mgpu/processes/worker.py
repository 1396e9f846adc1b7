"""Inside one worker process: its process group and death signal, its CPU binding, its signal handlers, joining the
job's process group through ``idist.Parallel``, and the error file the supervisor reads when the worker fails.

Torch-free at import (ignite is imported once the worker runs), like the rest of the process layer.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ignite_mgpu.cpus.binding import apply_binding, current, free_group_threads, thread_ids
from ignite_mgpu.env import clock, cluster, stop
from ignite_mgpu.processes import forkserver, hang_report, torchelastic
from ignite_mgpu.processes.attempt_files import RESULT_FILE, failure_record, write_result

if TYPE_CHECKING:
    from ignite_mgpu.processes.plan import LaunchPlan

# When the job function raised in this process (the failure file's time)
_raised_at: list[float] = []


def run_in_group(plan: LaunchPlan, fn: Callable[..., Any], args: tuple) -> Any:
    """Join the job's process group (or none, for one process) and run ``fn(local_rank, *args)`` in it; returns
    what ``fn`` returned."""
    import ignite.distributed as idist

    stop.set_collective_timeout(plan.timeout)
    for name in ("launcher.Parallel", "auto.auto_dataloader", "auto.auto_model", "auto.auto_optim"):
        # ignite keeps existing loggers.
        logging.getLogger(f"ignite.distributed.{name}").setLevel(logging.WARNING)
    before_group = thread_ids()
    own_group = _create_group(plan)
    returned = []  # Parallel.run drops what the function returns
    _raised_at.clear()  # one job's (a forked worker starts with its parent's memory)

    def run(local_rank: int, *args: Any) -> None:
        try:
            returned.append(fn(local_rank, *args))
        except BaseException:
            # Leaving Parallel destroys the process group, and the peers fail on it at once: the failure's time is
            # taken now, so that the supervisor names this rank's error as the cause, not theirs.
            _raised_at.append(time.time())
            raise

    try:
        with idist.Parallel(backend=None if own_group else plan.backend) as parallel:
            free_group_threads(before_group)  # cores: gloo's threads communicate on the job's CPUs
            _say_where(plan)
            parallel.run(run, *args)
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
    return returned[0] if returned else None


def _create_group(plan: LaunchPlan) -> bool:
    """Create the job's process group here where ignite's creation would go wrong (a spawned job's file store, a
    torchrun restart); False leaves it to ignite (env://, or no group for one process)."""
    if plan.backend is None:
        return False
    if plan.rendezvous_file is not None:
        store = _file_store(plan.rendezvous_file)
    else:
        store = _torchrun_attempt_store() if plan.external else None
    if store is None:
        return False
    import torch
    import torch.distributed as dist

    if plan.backend == "nccl" or torch.cuda.is_available():
        # Each rank's current device is its local rank's, as ignite sets it (gloo too: idist.device() reads it).
        torch.cuda.set_device(cluster.local_rank())
    world_size, _ = cluster.job_size()
    dist.init_process_group(plan.backend, store=store, rank=cluster.global_rank(), world_size=world_size)
    return True


def _file_store(path: str) -> Any:
    """Spawned on one node: the supervisor's private file store.

    Given ``init_method="file://..."``, ignite adds the rank and world size only to a URL without "env" in it (its
    test for env://): under a TMPDIR such as /scratch/venv-tmp, or in a temporary folder whose random name holds
    those letters, every rank failed with "rank parameter missing"; a "?" or "#" in the path would break the URL
    too. The store is made from the path itself.
    """
    import torch.distributed as dist

    return dist.FileStore(path, cluster.job_size()[0])


def _torchrun_attempt_store() -> Any:
    """Under torchrun, this restart's own namespace of the agent's store; None when torchrun did not start this
    process.

    torchrun keeps one store for the whole job, and the env:// rendezvous adds no per-restart prefix: processes
    it restarted would read the previous processes' addresses (gloo: "connectFullMesh failed ... Connection
    refused"). ignite then takes the group as it finds it.
    """
    agent_store = cluster.torchrun_store()
    if agent_store is None:
        return None
    import torch.distributed as dist

    host, port, restart = agent_store
    return dist.PrefixStore(f"ignite_mgpu/restart{restart}/", dist.TCPStore(host, port, is_master=False))


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


def _from_the_server(environ: dict[str, str], threads: int | None) -> None:
    """A worker forked by the fork server: the supervisor's environment replaces the server's (of when it started),
    and what torch read at its import in the server follows it: the intra-op threads (libgomp reads
    OMP_NUM_THREADS once, when it loads). ``threads``: the binding's own count, already applied."""
    # The server's objects (torch's, ignite's modules) leave the garbage collector's view: its first full pass over
    # them here would write to every one, copying the pages shared with the server (0.7 s of a restart, measured).
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    torch = sys.modules.get("torch")
    if torch is not None and threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


# A BLAS library's own thread-count variable, which it reads before OMP_NUM_THREADS.
BLAS_THREAD_VARS = {"openblas": "OPENBLAS_NUM_THREADS", "mkl": "MKL_NUM_THREADS", "blis": "BLIS_NUM_THREADS"}


def _blas_threads_as_torch(threads: int | None) -> None:
    """numpy's BLAS (OpenBLAS, MKL, BLIS) read their thread count from the environment once, when numpy loads: in
    the fork server, or in this worker while the job function's module was imported, before the binding. Without
    this, every worker's (and every loader worker's) matrix products would start a thread per core of the machine.
    Set each as a process that loaded numpy now would: its own variable (OPENBLAS_NUM_THREADS, ...) when set, else
    torch's count (the binding's, else OMP_NUM_THREADS). numpy not loaded yet: it will read the environment."""
    if "numpy" not in sys.modules:
        return
    omp = os.environ.get("OMP_NUM_THREADS", "")
    count = threads if threads is not None else int(omp) if omp.isdigit() else None
    if count is None:
        return
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    for api, var in BLAS_THREAD_VARS.items():
        own = os.environ.get(var, "")
        controller.select(internal_api=api).limit(limits=max(1, int(own) if own.isdigit() else count))


def _check_served_fork() -> None:
    """The server must never start CUDA (nor ask it anything): every worker it forks would then fail to use it."""
    torch = sys.modules.get("torch")
    # is_initialized() is false in a bad fork; only the private flag tells it (tests/test_private_apis.py)
    if torch is not None and (torch.cuda.is_initialized() or torch.cuda._is_in_bad_fork()):
        raise RuntimeError("the fork server touched CUDA before forking this worker (a bug of ignite-mgpu)")


def _set_signals(plan: LaunchPlan) -> None:
    """Ctrl-C is the launcher's, which passes it on: to the default job as SIGTERM (a stop at the next check), to a
    script as SIGINT (KeyboardInterrupt: its ``except KeyboardInterrupt`` and ``finally`` run, as under torchrun).
    SIGTERM and the pre-emption signal stop the job (a script's: its own handler, or the default action)."""
    # Python's own handler for a script (the worker's process may have started with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.SIG_IGN if plan.join_group else signal.default_int_handler)
    # The fork server starts with these blocked until it ignores them: a worker never keeps them blocked.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM, *filter(None, [plan.preempt_signal])])
    # A script knows nothing of our stop requests: SIGTERM ends it, as torchrun's SIGTERM does.
    signal.signal(signal.SIGTERM, _on_signal if plan.join_group else signal.SIG_DFL)
    # SLURM signals every process of the step, the workers too: the same stop.
    if plan.preempt_signal:
        # (a script's own handler, installed when it starts, or the default action: the script ends)
        signal.signal(plan.preempt_signal, _on_signal if plan.join_group else signal.SIG_DFL)


def _torchrun_variables(plan: LaunchPlan, local_rank: int, attempt: int, error_dir: str) -> dict[str, str]:
    """What torchrun would give this process (cluster.worker_environment), its error file that torch's @record
    fills included (read by the supervisor's report)."""
    rank = plan.node_rank * plan.nproc + local_rank
    # A requeued SLURM job's restarts count too (SLURM_RESTART_COUNT)
    restarts = cluster.outer_restarts() + attempt
    address = plan.master_addr, plan.master_port or 29500
    return cluster.worker_environment(
        rank,
        local_rank,
        plan.world_size,
        plan.nproc,
        plan.node_rank,
        *address,
        restarts,
        plan.max_restarts,
        run_id=plan.run_id,
        error_file=torchelastic.error_file(error_dir, rank),
    )


def worker_main(
    local_rank: int,
    plan: LaunchPlan,
    fn: Callable[..., Any],
    args: tuple,
    error_dir: str,
    attempt: int = 0,
    parent: int | None = None,
    environ: dict[str, str] | None = None,
) -> None:
    """The spawned (or forked) process's entry: set up the process, run ``fn``, exit with its code (an error file
    on failure; rank 0's return value in ``RESULT_FILE``). ``attempt``: the restart count (0: the first start).
    ``parent``: the pid of the process that started this one (the supervisor, or the fork server).
    ``environ``: the supervisor's environment, for a worker forked by the fork server (whose own is of when it
    started)."""
    forkserver.leave_server()
    forkserver.die_with(parent)  # the supervisor's, or the server's death
    # Own process group: Ctrl-C reaches only the launcher, which then stops the workers.
    os.setpgid(0, 0)
    binding = plan.binding.rank(local_rank)
    if environ is not None:
        _from_the_server({**environ, **plan.env}, binding.threads)
    for var in cluster.slurm_task_variables():
        # Inside an allocation ignite would read the launcher's SLURM task, not this rank.
        del os.environ[var]
    rank = plan.node_rank * plan.nproc + local_rank
    os.environ.update(plan.env)
    # Before anything imports torch here (unless unpickling the job function already did: then it resizes the pool).
    apply_binding(binding)
    _blas_threads_as_torch(binding.threads)
    os.environ.update(_torchrun_variables(plan, local_rank, attempt, error_dir))
    _set_signals(plan)
    # How far it got, and whether it is saving.
    stop.set_status_file(Path(error_dir, f"status{rank}"))
    hang_report.prepare_worker(error_dir, rank, plan.backend)  # its stacks on request; NCCL's Flight Recorder
    # When the command started, when the previous attempt failed: goodput's anchors.
    clock.set_clock(plan.clock)
    code = 0
    try:
        if environ is not None:
            _check_served_fork()
        value = run_in_group(plan, fn, args) if plan.join_group else fn(local_rank, *args)
        if rank == 0 and value is not None:
            write_result(Path(error_dir, RESULT_FILE), value)
    except BaseException as err:  # every failure becomes a failure file and an exit code
        record = failure_record(rank, err, _raised_at[0] if _raised_at else None)
        code = record["code"]
        Path(error_dir, f"rank{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a broken process group must not hang the exit
