"""Inside one worker process: what its attempt gives it (``WorkerSpec``), its process group and death signal, its
CPU binding, its signal handlers, joining the job's process group through ``idist.Parallel``, and the files it
leaves for the supervisor (its status, its failure, rank 0's return value).

Torch-free at import (ignite is imported once the worker runs), like the rest of the process layer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignite_mgpu.cpus.affinity import apply_binding, blas_threads_as_torch, current, free_group_threads, thread_ids
from ignite_mgpu.env import clock, cluster, stop
from ignite_mgpu.env.clock import JobClock
from ignite_mgpu.hangs import hang_report
from ignite_mgpu.processes import forkserver
from ignite_mgpu.processes.attempt_files import RESULT_FILE, error_file, failure_record, mark_raised, write_result
from ignite_mgpu.processes.job import Job
from ignite_mgpu.processes.plan import LaunchPlan


@dataclass(frozen=True)
class WorkerSpec:
    """What one attempt gives each of its workers (pickled for a spawned one)."""

    plan: LaunchPlan
    job: Job
    folder: str  # the attempt's folder: status, failure, error and stacks files
    clock: JobClock  # goodput's anchors: when the command started, when the previous attempt failed
    restarts: int = 0  # the job's restarts after a failure before this attempt (TORCHELASTIC_RESTART_COUNT)
    rendezvous_file: str | None = None  # a private file store on one node (None: env://)
    master_port: int | None = None  # MASTER_PORT: the plan's, or the attempt's own free port (a script's)
    parent: int | None = None  # the pid of the process that starts the worker: the supervisor, or the fork server
    # The supervisor's environment, for a worker forked by the fork server (whose own is of when it started)
    environ: Mapping[str, str] | None = None
    output: tuple[Any, Any] | None = None  # this worker's stdout and stderr channels (relay.py; None: inherited)


def run_in_group(plan: LaunchPlan, job: Job, rendezvous_file: str | None = None) -> Any:
    """Join the job's process group (or none, for one process) and run the job in it; returns what its function
    returned. ``rendezvous_file``: the attempt's private file store."""
    import ignite.distributed as idist

    stop.set_collective_timeout(plan.timeout)
    for name in ("launcher.Parallel", "auto.auto_dataloader", "auto.auto_model", "auto.auto_optim"):
        # ignite keeps existing loggers.
        logging.getLogger(f"ignite.distributed.{name}").setLevel(logging.WARNING)
    before_group = thread_ids()
    made_by = _create_group(plan, rendezvous_file)
    returned = []  # Parallel.run drops what the function returns

    def run(local_rank: int) -> None:
        try:
            returned.append(job.call(local_rank))
        except BaseException as err:
            mark_raised(err)  # before Parallel destroys the group: the peers' errors come later
            raise

    try:
        with idist.Parallel(backend=None) as parallel:  # the group is made here (_create_group), or none
            free_group_threads(before_group)  # cores: gloo's threads communicate on the job's CPUs
            _say_where(plan)
            parallel.run(run)
            if idist.get_world_size() > 1:
                # A gloo thread releases the last collective's tensors a moment after wait() returned, and needs
                # the GIL for it. A process that exits normally (started by torchrun or srun) can reach interpreter
                # shutdown first; the thread then dies there ("terminate called without an active exception",
                # SIGABRT) and a finished job counts as failed. Waiting here releases the GIL until every rank is
                # done, so those threads finish first. (Spawned workers skip the shutdown with os._exit.)
                idist.barrier()
    finally:
        if made_by == "ignite":
            idist.finalize()
        elif made_by == "here":
            import torch.distributed as dist

            dist.destroy_process_group()
    return returned[0] if returned else None


def _create_group(plan: LaunchPlan, rendezvous_file: str | None) -> str | None:
    """Create the job's process group, its collectives bounded by ``dist.timeout`` from the start (the first step
    and the set-up before it too: ``stop.group_timeout``): "here" on a store of our own, where ignite's creation
    would go wrong (a spawned job's file store, a torchrun restart), "ignite" through ``idist.initialize``
    (env://), None for one process (no group)."""
    if plan.backend is None:
        return None
    if rendezvous_file is not None:
        store = _file_store(rendezvous_file)
    else:
        store = _torchrun_attempt_store() if plan.external else None
    if store is None:
        import ignite.distributed as idist

        # ignite's Parallel(backend=...) would create it without a timeout: torch's 10 (NCCL) or 30 (gloo) minutes.
        idist.initialize(plan.backend, timeout=stop.group_timeout())
        return "ignite"
    import torch
    import torch.distributed as dist

    if plan.backend == "nccl" or torch.cuda.is_available():
        # Each rank's current device is its local rank's, as ignite sets it (gloo too: idist.device() reads it).
        torch.cuda.set_device(cluster.local_rank())
    world_size, _ = cluster.job_size()
    rank = cluster.global_rank()
    dist.init_process_group(plan.backend, store=store, rank=rank, world_size=world_size, timeout=stop.group_timeout())
    return "here"


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
    if signum == signal.SIGINT and stop.stop_requested() and not stop.repeats_request(signum):
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


def torchrun_variables(spec: WorkerSpec, local_rank: int) -> dict[str, str]:
    """What torchrun would give this process (cluster.worker_environment), its error file that torch's @record
    fills included (read by the supervisor's report)."""
    plan = spec.plan
    rank = plan.first_rank + local_rank
    # A requeued SLURM job's restarts count too (SLURM_RESTART_COUNT)
    restarts = cluster.outer_restarts() + spec.restarts
    return cluster.worker_environment(
        rank,
        local_rank,
        plan.world_size,
        plan.nproc,
        plan.node_rank,
        plan.master_addr,
        spec.master_port or 29500,
        restarts,
        plan.max_restarts,
        run_id=plan.run_id,
        error_file=error_file(spec.folder, rank),
    )


def _set_up(spec: WorkerSpec, local_rank: int) -> None:
    """This process as the attempt's worker ``local_rank``: its own process group, the supervisor's environment and
    the plan's, its CPUs and threads (before anything imports torch here, unless unpickling the job already did:
    then its pool is resized), the torchrun variables, the signals, the files the supervisor reads."""
    forkserver.leave_server()
    forkserver.die_with(spec.parent)  # the supervisor's, or the server's death
    # Own process group: Ctrl-C reaches only the launcher, which then stops the workers.
    os.setpgid(0, 0)
    plan = spec.plan
    binding = plan.binding.rank(local_rank)
    if spec.environ is not None:
        forkserver.from_the_server({**spec.environ, **plan.env}, binding.threads)
    for var in cluster.slurm_task_variables():
        # Inside an allocation ignite would read the launcher's SLURM task, not this rank.
        del os.environ[var]
    os.environ.update(plan.env)
    apply_binding(binding)
    blas_threads_as_torch(binding.threads)
    os.environ.update(torchrun_variables(spec, local_rank))
    _set_signals(plan)
    rank = plan.first_rank + local_rank
    # How far it got, and whether it is saving: what the supervisor's hang watch reads.
    stop.set_status_file(Path(spec.folder, f"status{rank}"))
    hang_report.prepare_worker(spec.folder, rank, plan.backend)  # its stacks on request; NCCL's Flight Recorder
    clock.set_clock(spec.clock)


def take_output(output: tuple[Any, Any] | None) -> None:
    """Write stdout and stderr into the relay's channels (``Connection`` objects), this process's children too."""
    if output is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, channel in zip((1, 2), output, strict=True):
        os.dup2(channel.fileno(), fd)
        channel.close()


def worker_main(local_rank: int, spec: WorkerSpec) -> None:
    """The spawned (or forked) process's entry: set up the process, run the job, exit with its code (a failure
    file on failure; rank 0's return value in ``RESULT_FILE``)."""
    take_output(spec.output)
    _set_up(spec, local_rank)
    rank = spec.plan.first_rank + local_rank
    code = 0
    try:
        if spec.environ is not None:
            forkserver.check_served_fork()
        if spec.plan.join_group:
            value = run_in_group(spec.plan, spec.job, spec.rendezvous_file)
        else:
            value = spec.job.call(local_rank)
        if rank == 0 and value is not None:
            write_result(Path(spec.folder, RESULT_FILE), value)
    except BaseException as err:  # every failure becomes a failure file and an exit code
        record = failure_record(rank, err)
        code = record["code"]
        Path(spec.folder, f"rank{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a broken process group must not hang the exit
