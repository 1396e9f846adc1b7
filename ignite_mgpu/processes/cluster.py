"""What an outer scheduler (torchrun, SLURM) tells a job and asks of it: how often it restarted the job, and the
pre-emption requeue (``scontrol requeue $SLURM_JOB_ID``) once every rank has checkpointed. Torch-free."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from typing import Any


def outer_restarts(environ: Mapping[str, str] = os.environ) -> int:
    """How many times torchrun (``TORCHELASTIC_RESTART_COUNT``) or SLURM (``SLURM_RESTART_COUNT``, a requeue) has
    started this job again; 0 when neither did."""
    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def signal_number(name: str | None) -> int | None:
    """``dist.preempt_signal`` ("SIGUSR1") as a number; None when it is off."""
    return int(signal.Signals[name]) if name else None


def requeue(environ: Mapping[str, str] = os.environ, run: Callable[..., Any] = subprocess.run) -> str:
    """Requeue the SLURM job this process runs in (``scontrol requeue $SLURM_JOB_ID``); the line to print.

    Called once per job, by the launcher of global rank 0, after every rank stopped at the same iteration and the
    checkpoint was written: the requeued job continues from it through ``--resume auto``.
    """
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return "not requeued: this is not a SLURM job (no SLURM_JOB_ID); continue it with --resume auto."
    try:
        done = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return f"could not requeue SLURM job {job} (scontrol requeue {job}: {err}); resubmit it with --resume auto."
    if done.returncode != 0:
        why = (done.stderr or done.stdout or "").strip().splitlines()
        return (
            f"could not requeue SLURM job {job} (scontrol requeue {job} exited {done.returncode}"
            f"{': ' + why[-1] if why else ''}); submit it with sbatch --requeue, or resubmit it with --resume auto."
        )
    return f"requeued SLURM job {job} (scontrol requeue {job}); it continues from the checkpoint with --resume auto."
