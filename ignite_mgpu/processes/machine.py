"""What the launch plan knows of this machine besides its GPU snapshot: how many CUDA devices PyTorch sees, its CPUs,
its loopback interface (``probe_machine``), its free ports; and the checks of a request against them and against
an outer launcher (torchrun, SLURM) that started this process. Torch-free at import: torch is asked once, and only
on a machine with a GPU driver."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.env import cluster
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus.selection import GpuPlan


@dataclass(frozen=True)
class Machine:
    """What deciding needs to know about this machine besides the GPU snapshot, read once by ``probe_machine``."""

    cuda_devices: int  # CUDA devices PyTorch sees, with the chosen GPUs' environment in effect
    torch_version: str = ""
    cuda_build: str | None = None  # torch.version.cuda: None for a CPU-only build of PyTorch
    cpu_count: int = 1
    loopback: bool = True  # the machine has a "lo" interface


# What a GPU driver puts on a machine: NVIDIA's (Linux, and WSL2's /dev/dxg) and ROCm's, whose GPUs torch.cuda shows.
GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def probe_machine() -> Machine:
    """Ask torch how many CUDA devices it sees (CUDA reads CUDA_VISIBLE_DEVICES now, at its first use). A machine
    without a GPU driver has none, and this process then does not import torch (about 3 s on a small machine)."""
    loopback = any(name == "lo" for _, name in socket.if_nameindex())
    if not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return Machine(0, cpu_count=os.cpu_count() or 1, loopback=loopback)
    import torch

    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Machine(n_cuda, torch.__version__, torch.version.cuda, os.cpu_count() or 1, loopback)


def check_devices(cfg: DistConfig, backend: str, gpu_plan: GpuPlan | None, machine: Machine) -> None:
    """The backend, the chosen GPUs and the strategy against what PyTorch sees."""
    n_cuda = machine.cuda_devices
    if backend == "nccl" and not n_cuda:
        raise ConfigError(
            "--backend nccl needs CUDA, but no GPU is visible to PyTorch here. Use --backend gloo (CPU) or "
            "--backend auto, or check CUDA_VISIBLE_DEVICES and the driver (ignite-mgpu devices)."
        )
    if gpu_plan is not None and gpu_plan.physical_ids and not n_cuda:
        version, cuda_build = machine.torch_version, machine.cuda_build
        if not version:  # not probed: this machine has no GPU driver
            import torch

            version, cuda_build = torch.__version__, torch.version.cuda
        built = "without CUDA" if cuda_build is None else f"for CUDA {cuda_build}"
        raise ConfigError(
            f"--gpus {cfg.gpus} selects GPUs that nvidia-smi shows, but PyTorch sees no CUDA device (torch "
            f"{version}, built {built}); the job would silently train on the CPU. Install a CUDA "
            "build of PyTorch that matches the driver, or pass --gpus none to train on the CPU."
        )
    if cfg.strategy == "dp":
        if not n_cuda:
            raise ConfigError("--strategy dp (nn.DataParallel) needs GPUs; on the CPU use the default --strategy ddp.")
        if (cfg.nproc or 1) != 1 or cfg.nnodes != 1:
            raise ConfigError("--strategy dp runs ONE process that drives every selected GPU; drop --nproc/--nnodes.")


def check_outer_launcher(cfg: DistConfig, environ: Mapping[str, str]) -> None:
    """Under torchrun/SLURM the outer launcher decides the processes and restarts them."""
    if not cluster.started_externally(environ):
        return
    if cfg.nproc is not None or (cfg.gpus or "").startswith("auto"):
        raise ConfigError(
            "this process was started by torchrun/SLURM, which decides the processes: drop --nproc, and choose "
            "GPUs with physical ids (--gpus 2,3) or CUDA_VISIBLE_DEVICES, not --gpus auto (each process would "
            "choose on its own)."
        )
    if cfg.wait is not None:
        raise ConfigError(
            "--wait: this process was started by torchrun/SLURM, which own the GPUs they give a job (ignite-mgpu "
            "claims GPUs and waits for them only for the jobs it starts itself). Drop --wait; under SLURM the "
            "scheduler queues the job until its GPUs are free."
        )
    if cfg.max_restarts:
        raise ConfigError(
            f"--max-restarts {cfg.max_restarts}: this process was started by torchrun/SLURM, which starts (and "
            "restarts) the processes; one of them cannot restart the others. Let the outer launcher restart the "
            "job and resume it: torchrun --max-restarts N ... train --resume auto, or sbatch --requeue with "
            "--resume auto; and drop --max-restarts."
        )


def check_port_free(addr: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError as err:
            raise ConfigError(
                f"--master-port {port} is already in use on this machine ({err.strerror}); another job (or an "
                "earlier run that is still alive) is listening there. Pick another port, or leave --master-port "
                "out on a single node so a private rendezvous is used."
            ) from None


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on now, for a rendezvous of a script on one node (ignite-mgpu run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr if addr != "localhost" else "127.0.0.1", 0))
        return int(s.getsockname()[1])
