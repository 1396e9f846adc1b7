"""What the experiment trackers record about a run besides its numbers: the resolved config flattened into
parameters, the physical GPUs of every rank (names, UUIDs), the number of processes, the restarts and the code
version (ignite_mgpu's, and the git commit of the working directory when it is a repository)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from typing import Any, cast

import ignite.distributed as idist
import torch

import ignite_mgpu
from ignite_mgpu.config.schema import Config
from ignite_mgpu.gpus.inventory import query_gpus

# Seconds: a slow file system or a huge repository must not hold the start of training.
GIT_TIMEOUT = 5.0


def flat_config(cfg: Config) -> dict[str, str]:
    """Every key of the resolved config as a dotted name (``optim.lr``), nested mappings included
    (``model.args.hidden``); values as the YAML writes them."""
    from omegaconf import OmegaConf

    def walk(node: Any, prefix: str) -> dict[str, str]:
        if isinstance(node, dict) and node:
            return {k: v for key, value in node.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        # Null, true, 0.05, [1, 2].
        return {prefix[:-1]: node if isinstance(node, str) else json.dumps(node)}

    return walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")


def this_process_gpus(devices: list[torch.device]) -> list[dict[str, Any]]:
    """The CUDA devices this process drives: rank, host, CUDA index, physical id (as nvidia-smi numbers it), name
    and UUID. [] on the CPU."""
    found = []
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    for device in devices:
        if device.type != "cuda":
            continue
        index = device.index or 0
        props = torch.cuda.get_device_properties(index)
        uuid = str(props.uuid)
        # Replaced by the snapshot's on rank 0.
        physical = visible[index] if index < len(visible) else str(index)
        found.append(
            {
                "rank": idist.get_rank(),
                "host": socket.gethostname(),
                "cuda": index,
                "physical": physical,
                "name": props.name,
                "uuid": uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}",
            }
        )
    return found


def job_gpus(devices: list[torch.device]) -> list[dict[str, Any]]:
    """Every rank's GPUs, gathered (a collective: every rank calls it), with the physical ids of this machine's
    snapshot (NVML / nvidia-smi) where the UUIDs match. [] on the CPU, where no rank has a GPU."""
    # The same device type on every rank: all skip together.
    if not any(d.type == "cuda" for d in devices):
        return []
    local = json.dumps(this_process_gpus(devices))
    rows = cast(list[str], idist.all_gather(local)) if idist.get_world_size() > 1 else [local]
    gpus = [gpu for row in rows for gpu in json.loads(row)]
    if idist.get_rank() == 0:
        here = socket.gethostname()
        physical = {g.uuid: str(g.index) for g in query_gpus() if g.uuid}
        for gpu in gpus:
            if gpu["host"] == here and gpu["uuid"] in physical:
                gpu["physical"] = physical[gpu["uuid"]]
    return gpus


def describe_gpus(gpus: list[dict[str, Any]]) -> str:
    """One line: "rank 0: GPU 2 NVIDIA H100 (GPU-8a0e...) on node1; ..."; "none" on the CPU."""
    if not gpus:
        return "none"
    return "; ".join(f"rank {g['rank']}: GPU {g['physical']} {g['name']} ({g['uuid']}) on {g['host']}" for g in gpus)


def git_commit(cwd: str | None = None) -> tuple[str | None, bool | None]:
    """(the commit of HEAD, whether tracked files differ from it) of the working directory's git repository;
    (None, None) outside one, without git, or when git takes longer than ``GIT_TIMEOUT``."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def run_facts(world_size: int, restarts: int, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """The facts of one start of the run, as every tracker records them (``ignite_mgpu.<key>``)."""
    commit, dirty = git_commit()
    return {
        "processes": world_size,
        "restarts": restarts,
        "gpus": describe_gpus(gpus),
        "version": ignite_mgpu.__version__,
        "git_commit": commit if commit is not None else "unknown",
        "git_dirty": "unknown" if dirty is None else str(dirty).lower(),
    }
