"""Everything an outer launcher (torchrun, SLURM) tells a job through its environment, read in one place: whether
it started this process, the process's rank and the job's size, the job's id, how often it restarted the job; the
environment a worker gets (what torchrun would give it), and the pre-emption requeue (``scontrol requeue
$SLURM_JOB_ID``). Torch-free."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Mapping
from typing import Any

# torchrun (torch.distributed.run) sets all three.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# The one SLURM variable a spawned worker keeps (restarts)
KEPT_SLURM_VARS = ("SLURM_RESTART_COUNT",)


def started_externally(environ: Mapping[str, str] = os.environ) -> bool:
    """torchrun or srun (a SLURM step of several tasks) started this process: it joins their group, spawns nothing."""
    if all(k in environ for k in TORCHRUN_VARS):
        return True
    return "SLURM_JOB_ID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ


def global_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank in the job as torchrun (RANK) or SLURM (SLURM_PROCID) numbers it; 0 when neither does."""
    return int(environ.get("RANK", environ.get("SLURM_PROCID", "0")))


def local_rank(environ: Mapping[str, str] = os.environ) -> int:
    return int(environ.get("LOCAL_RANK", "0"))


def is_first_process(environ: Mapping[str, str] = os.environ) -> bool:
    """The job's first process, which alone checks and locks the output folder and requeues a pre-empted job."""
    return global_rank(environ) == 0


def job_size(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(processes in the job, processes on this node) as torchrun or SLURM started them."""
    world = int(environ.get("WORLD_SIZE", environ.get("SLURM_NTASKS", "1")))
    # SLURM writes "4(x2)" for 4 tasks on each of 2 nodes.
    local = int(environ.get("LOCAL_WORLD_SIZE", environ.get("SLURM_NTASKS_PER_NODE", str(world))).split("(")[0])
    return world, local


def job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The id every process and every requeue of the job shares (SLURM_JOB_ID, torchrun's --rdzv-id), or None."""
    found = environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID")
    return found if found and found != "none" else None  # torchrun without --rdzv-id says "none"


def torchrun_store(environ: Mapping[str, str] = os.environ) -> tuple[str, int, str] | None:
    """(host, port, restart count) of torchrun's agent store when this process should use it, else None."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def run_id(environ: Mapping[str, str], nnodes: int) -> str:
    """The job's ``TORCHELASTIC_RUN_ID``: the scheduler's job id (SLURM_JOB_ID) when there is one, shared by every
    node and every requeue; else one of its own on one node (as ``torchrun --standalone``), and on several nodes
    ``"none"``, which torchrun without ``--rdzv-id`` gives too (each node's launcher would pick another)."""
    found = job_id(environ)
    if found is not None:
        return found
    return uuid.uuid4().hex if nnodes == 1 else "none"


def worker_environment(
    rank: int,
    local: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    restart_count: int = 0,
    max_restarts: int = 0,
    run_id: str = "none",
    error_file: str = "",
) -> dict[str, str]:
    """The variables a spawned worker gets: the ones torchrun gives its processes, so ``idist``,
    ``init_process_group()``, ``is_torchelastic_launched()`` (TORCHELASTIC_RUN_ID, which Lightning reads) and a
    script written for torchrun read them as they would under torchrun. TORCHELASTIC_USE_AGENT_STORE is "False":
    the job's rank 0 hosts the rendezvous store on MASTER_PORT, as under torchrun's static rendezvous.
    ``error_file``: where torch's ``@record`` writes the rank's uncaught error (TORCHELASTIC_ERROR_FILE)."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(world_size // local_world_size),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    return env


def slurm_task_variables(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The SLURM variables a spawned worker must drop: inside an allocation ignite would read the launcher's SLURM
    task from them, not the worker's rank."""
    return [v for v in environ if v.startswith("SLURM_") and v not in KEPT_SLURM_VARS]


def outer_restarts(environ: Mapping[str, str] = os.environ) -> int:
    """How many times torchrun (``TORCHELASTIC_RESTART_COUNT``) or SLURM (``SLURM_RESTART_COUNT``, a requeue) has
    started this job again; 0 when neither did."""
    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def signal_number(name: str | None) -> int | None:
    """``dist.preempt_signal`` ("SIGUSR1" or "USR1") as a number; None when it is off."""
    from ignite_mgpu.config.checks import signal_name

    return int(signal.Signals[signal_name(name)]) if name else None


def requeue(
    environ: Mapping[str, str] = os.environ, run: Callable[..., Any] = subprocess.run, script: bool = False
) -> str:
    """Requeue the SLURM job this process runs in (``scontrol requeue $SLURM_JOB_ID``); the line to print.

    Called once per job, by the launcher of global rank 0, after every rank stopped: the default job stopped at
    the same iteration and wrote a checkpoint, and the requeued job continues from it through ``--resume auto``;
    a ``script`` (``ignite-mgpu run``) starts again and continues from its own snapshot.
    """
    resume = "" if script else " with --resume auto"
    job = environ.get("SLURM_JOB_ID")
    if not job:
        again = "start it again" if script else "continue it with --resume auto"
        return f"not requeued: this is not a SLURM job (no SLURM_JOB_ID); {again}."
    try:
        done = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return f"could not requeue SLURM job {job} (scontrol requeue {job}: {err}); resubmit it{resume}."
    if done.returncode != 0:
        why = (done.stderr or done.stdout or "").strip().splitlines()
        return (
            f"could not requeue SLURM job {job} (scontrol requeue {job} exited {done.returncode}"
            f"{': ' + why[-1] if why else ''}); submit it with sbatch --requeue, or resubmit it{resume}."
        )
    then = (
        "the script starts again (TORCHELASTIC_RESTART_COUNT counts the requeue)"
        if script
        else "it continues from the checkpoint with --resume auto"
    )
    return f"requeued SLURM job {job} (scontrol requeue {job}); {then}."
