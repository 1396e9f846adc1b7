"""The launch plan: backend, processes, GPUs, rendezvous, CPU binding and restarts, decided once in the parent
before anything is spawned (``make_plan``); and ``Restart``, what a job's restart hook gives the supervisor.

Deciding is a pure function of the config, the GPU snapshot and a few facts about this machine (``decide``).
Torch-free at import: torch is asked how many CUDA devices it sees, once, when the plan is made.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.cpus.binding import BindingPlan, plan_for_job
from ignite_mgpu.env import cluster
from ignite_mgpu.env.clock import JobClock, command_start
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import acquire, selection
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.gpus.ranges import GpuRange, gpu_range
from ignite_mgpu.processes import torchelastic


@dataclass
class LaunchPlan:
    """Everything the supervisor and the workers need, decided once in the parent."""

    backend: str | None  # "nccl", "gloo", or None for a single process without a process group
    nproc: int  # processes on this node
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # A file store's path (private rendezvous on one node) or None (env://)
    rendezvous_file: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # set in every worker before torch starts
    timeout: float = 300.0
    stop_grace: float = 60.0
    # The hang watch's shortest window (processes/heartbeat.py; 0: off), and the run folder its report goes to.
    hang_seconds: float = 60.0
    run_dir: str | None = None
    strategy: str = "ddp"
    external: bool = False  # started by torchrun / SLURM: join, spawn nothing
    # Physical GPU ids in CUDA order (None: as the environment has them)
    gpus: list[int] | None = None
    gpu_names: dict[int, str] = field(default_factory=dict)  # physical id -> its claim name (UUID), to find it again
    # --gpus auto:MIN-MAX: the restart leaves out a lost GPU, not below MIN (elastic.py); lends GPUs (resize.py)
    gpu_range: GpuRange | None = None
    # The backend of the job's process group, also while one process needs none (a range that may grow).
    group_backend: str = "gloo"
    # dist.min_free_memory: a GPU with less free is not free for an elastic job to take (resize.py)
    min_free_memory: float = 0.0
    # The CPUs that OMP_NUM_THREADS divides among the processes when the plan set it (0: the user's or unset).
    cpu_share: int = 0
    device: str = "cpu"  # what the workers train on: "cuda" or "cpu"
    # Run even a single process in a spawned worker, whose CUDA starts fresh.
    spawn_one: bool = False
    messages: list[str] = field(default_factory=list)
    binding: BindingPlan = field(default_factory=BindingPlan)  # CPUs and threads of each local rank
    # Restarts of the whole group after a failure a restart can cure (supervisor.py)
    max_restarts: int = 0
    # The pre-emption signal: checkpoint, stop, requeue the SLURM job.
    preempt_signal: int | None = None
    # The job's GPU claims, held by the launching process until the job ends (run_plan releases them).
    claims: GpuClaims = field(default_factory=GpuClaims, compare=False, repr=False)
    # "forkserver" (launch/forkserver.py): a job joining the group; "spawn": a user's script (ignite-mgpu run),
    # started in a fresh interpreter as python would run it; "fork": from a notebook (its function, a fresh process
    # cannot import).
    start_method: str = "spawn"
    # False: the job creates its own process group (ignite-mgpu run: a user's script)
    join_group: bool = True
    # TORCHELASTIC_RUN_ID of the workers (torchelastic.run_id): is_torchelastic_launched() is True, as under torchrun
    run_id: str = "none"
    # When the command started (and, for a restart, when the previous attempt failed): goodput's anchors.
    clock: JobClock = field(default_factory=lambda: JobClock(command_start()), compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


@dataclass
class Restart:
    """What a job's restart hook returns for restart k: the new arguments of ``fn`` and where they resume."""

    args: tuple
    # The checkpoint the restarted job resumes from (None: from its beginning)
    checkpoint: str | None = None
    iteration: int = 0  # that checkpoint's iteration
    # False: a plain function run again (launch()), nothing known about its progress.
    resumes: bool = True
    # What runs again from its start when it does not resume (a script's name)
    name: str = "the job function"


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


def make_plan(
    cfg: DistConfig, environ: dict[str, str] | os._Environ[str] = os.environ, join_group: bool = True
) -> LaunchPlan:
    """Decide backend, process count, GPUs and rendezvous from ``cfg`` and this machine.

    The chosen GPUs' environment (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER) is the one change to ``environ``, made
    before torch is asked anything: CUDA reads it once, when this process first asks. Everything else the plan
    sets (``plan.env``) is applied in the workers. A job on GPUs claims them (``acquire.py``; ``plan.claims``,
    released by ``run_plan``, or here when a check fails); one that torchrun or SLURM started claims nothing.
    ``join_group=False``: a script that creates its own process group from the torchrun environment
    (``launch/script.py``), on whichever backend it chooses.

    Raises:
        ConfigError: every impossible request, before anything is spawned.
    """
    check_outer_launcher(cfg, environ)
    external = cluster.started_externally(environ)
    gpu_plan, held = None, GpuClaims()
    try:
        if cfg.gpus is not None:
            gpu_plan, held = acquire.acquire(cfg, environ, claim=not external)
            selection.check_cuda_not_initialized(gpu_plan.physical_ids, environ)
            environ.update(gpu_plan.env)
        plan = decide(cfg, gpu_plan, probe_machine(), environ, join_group)
        # The GPUs as the environment has them.
        if cfg.gpus is None and plan.device == "cuda" and not external:
            held = acquire.acquire(cfg, environ)[1]
        if plan.backend is not None and not plan.external and cfg.master_port is not None and cfg.node_rank == 0:
            check_port_free(cfg.master_addr, cfg.master_port)
        on_gpu = plan.device == "cuda" and not plan.external
        binding = plan_for_job(
            cfg.cpu_binding, plan.nproc, plan.gpus, on_gpu, cfg.strategy, environ, external=plan.external
        )
    except BaseException:
        held.close()
        raise
    return dataclasses.replace(plan, binding=binding, claims=held, run_id=torchelastic.run_id(environ, cfg.nnodes))


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


def decide(
    cfg: DistConfig,
    gpu_plan: selection.GpuPlan | None,
    machine: Machine,
    environ: Mapping[str, str],
    join_group: bool = True,
) -> LaunchPlan:
    """The plan without its CPU binding: a pure function of the config, the chosen GPUs, the machine and the
    launcher's environment (read only). A script (``join_group=False``) chooses its own backend: the checks of
    ours (nccl needs a GPU per process) are its to make."""
    n_cuda = machine.cuda_devices
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if n_cuda else "gloo")
    check_devices(cfg, backend, gpu_plan, machine)
    messages = list(gpu_plan.messages) if gpu_plan else []
    if cluster.started_externally(environ):
        return _external_plan(cfg, backend, n_cuda, messages, environ)
    chosen = gpu_plan.physical_ids if gpu_plan else None
    selected = len(chosen) if chosen else n_cuda
    nproc = cfg.nproc if cfg.nproc is not None else (selected if selected and cfg.strategy != "dp" else 1)
    if cfg.strategy == "fsdp":
        _check_fsdp_processes(cfg, nproc, chosen, messages)
    if backend == "nccl" and nproc > n_cuda and join_group:
        raise ConfigError(
            f"--nproc {nproc} with nccl needs {nproc} GPUs, but {n_cuda} {'is' if n_cuda == 1 else 'are'} visible; "
            f"NCCL cannot put two ranks on one GPU. Use --nproc {n_cuda}, select more GPUs with --gpus, or use "
            "--backend gloo."
        )
    plan = LaunchPlan(
        backend=backend if nproc * cfg.nnodes > 1 else None,
        nproc=nproc,
        nnodes=cfg.nnodes,
        node_rank=cfg.node_rank,
        master_addr=cfg.master_addr,
        master_port=cfg.master_port,
        timeout=cfg.timeout,
        stop_grace=cfg.stop_grace,
        hang_seconds=cfg.hang_seconds,
        strategy=cfg.strategy,
        gpus=chosen,
        gpu_names=dict(gpu_plan.names) if gpu_plan else {},
        gpu_range=gpu_range(cfg.gpus),
        group_backend=backend,
        min_free_memory=cfg.min_free_memory,
        device="cuda" if n_cuda else "cpu",
        # CUDA reads CUDA_VISIBLE_DEVICES once, when this process first asks it anything (torch.cuda.is_available()
        # included, without is_initialized() turning true), and this process may have asked before --gpus was
        # applied: a job on chosen GPUs always runs in a spawned process, also a single one.
        # A restart needs a process to restart: one process with --max-restarts runs in a spawned worker too.
        # A script always runs in spawned workers: they get the torchrun environment, this process supervises.
        spawn_one=bool(chosen) or cfg.max_restarts > 0 or not join_group,
        messages=messages,
        max_restarts=cfg.max_restarts,
        preempt_signal=cluster.signal_number(cfg.preempt_signal),
        join_group=join_group,
        start_method="forkserver" if join_group else "spawn",
    )
    # A range that may grow from one process has the group's environment ready.
    if plan.backend is not None or (plan.gpu_range is not None and plan.gpu_range.high > 1):
        _group_environment(plan, backend, n_cuda, gpu_plan is None and join_group, machine, environ)
    return plan


def check_devices(cfg: DistConfig, backend: str, gpu_plan: selection.GpuPlan | None, machine: Machine) -> None:
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


def _group_environment(
    plan: LaunchPlan, backend: str, n_cuda: int, gpus_as_found: bool, machine: Machine, environ: Mapping[str, str]
) -> None:
    """The workers' environment for a process group: loopback sockets on one node, CPU threads per process."""
    if plan.nnodes == 1:
        # Keep gloo/NCCL's own sockets on loopback: nothing of a single-node job listens on the network.
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if var not in environ and machine.loopback:
                plan.env[var] = "lo"
    if backend == "gloo" and 0 < n_cuda < plan.nproc and gpus_as_found:
        # ignite puts rank k on cuda:k whenever CUDA is visible; with more ranks than GPUs, train on the CPU.
        plan.env["CUDA_VISIBLE_DEVICES"] = ""
        plan.device = "cpu"
        plan.messages.append(f"--backend gloo with {plan.nproc} processes and {n_cuda} GPU(s): training on the CPU.")
    if backend == "gloo" and "OMP_NUM_THREADS" not in environ:
        # No oversubscription.
        plan.cpu_share = machine.cpu_count
        plan.env["OMP_NUM_THREADS"] = str(max(1, machine.cpu_count // plan.nproc))


def _check_fsdp_processes(cfg: DistConfig, nproc: int, chosen: list[int] | None, messages: list[str]) -> None:
    """FSDP shards over processes, one per GPU: one process driving several chosen GPUs is DataParallel's layout and
    is refused; a job of one process is allowed (it shards nothing) with a note."""
    if chosen and nproc < len(chosen):
        raise ConfigError(
            f"--strategy fsdp with --nproc {nproc} on the {len(chosen)} GPUs that --gpus {cfg.gpus} selects: FSDP "
            "shards over processes, one per GPU, and a process never drives several GPUs (that is --strategy dp's "
            f"layout), so {len(chosen) - nproc} GPU(s) would sit idle. Drop --nproc (a process per selected GPU), "
            f"or select {nproc} GPU(s) with --gpus."
        )
    if nproc * cfg.nnodes == 1:
        messages.append(
            "--strategy fsdp with one process: nothing to shard, the model is placed whole as with ddp; start "
            "several processes (--nproc N) to shard it."
        )


def _external_plan(
    cfg: DistConfig, backend: str, n_cuda: int, messages: list[str], environ: Mapping[str, str]
) -> LaunchPlan:
    """The plan of a process that torchrun or SLURM started: it joins their group; the GPU checks still apply."""
    world, nproc = cluster.job_size(environ)
    if cfg.strategy == "dp" and world > 1:
        raise ConfigError(
            f"--strategy dp under torchrun/SLURM with {world} processes: every process would build a DataParallel "
            "over every GPU it sees and hold memory on all of them. DataParallel is one process driving several "
            "GPUs: start one process (--nproc_per_node 1 / --ntasks 1), or drop --strategy dp for DDP."
        )
    if n_cuda and nproc > n_cuda:
        raise ConfigError(
            f"{nproc} processes on this node (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE) but this process sees "
            f"{n_cuda} GPU(s): each process trains on cuda:LOCAL_RANK, so every process must see every GPU of the "
            "node. Start as many processes as GPUs, make all of the node's GPUs visible to each process (SLURM: "
            "--gpus-per-node rather than --gpus-per-task, or --gpu-bind=none), or hide them all "
            "(CUDA_VISIBLE_DEVICES=) to train on the CPU with gloo."
        )
    return LaunchPlan(
        backend,
        nproc,
        nnodes=max(1, world // nproc),
        timeout=cfg.timeout,
        stop_grace=cfg.stop_grace,
        hang_seconds=cfg.hang_seconds,
        strategy=cfg.strategy,
        external=True,
        device="cuda" if n_cuda else "cpu",
        messages=messages,
        preempt_signal=cluster.signal_number(cfg.preempt_signal),
    )
