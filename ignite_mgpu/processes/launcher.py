"""Processes: the launch plan (backend, nproc, GPUs, rendezvous), decided once in the parent; ``supervisor.py``
spawns one worker per process and runs ``fn(local_rank, *args)`` inside ``idist.Parallel`` there.

Under torchrun or SLURM nothing is spawned: the process joins the existing group. Exit codes: errors.EXIT_CODES.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ignite_mgpu.config import DistConfig
from ignite_mgpu.errors import FAILED, SUCCESS, ConfigError, TrainingStopped, is_user_error, signal_exit_code
from ignite_mgpu.processes import cluster as scheduler
from ignite_mgpu.processes.binding import BindingPlan, apply_binding, plan_for_job
from ignite_mgpu.processes.supervisor import Restart, Supervisor
from ignite_mgpu.processes.worker import in_process_signals, run_in_group


@dataclass
class LaunchPlan:
    """Everything the supervisor and the workers need, decided once in the parent."""

    backend: str | None  # "nccl", "gloo", or None for a single process without a process group
    nproc: int  # processes on this node
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    init_method: str | None = None  # "file://..." (private rendezvous on one node) or None (env://)
    env: dict[str, str] = field(default_factory=dict)  # set in every worker before torch starts
    timeout: float = 300.0
    stop_grace: float = 60.0
    strategy: str = "ddp"
    external: bool = False  # started by torchrun / SLURM: join, spawn nothing
    gpus: list[int] | None = None  # physical GPU ids in CUDA order (None: as the environment has them)
    device: str = "cpu"  # what the workers train on: "cuda" or "cpu"
    spawn_one: bool = False  # run even a single process in a spawned worker, whose CUDA starts fresh
    messages: list[str] = field(default_factory=list)
    binding: BindingPlan = field(default_factory=BindingPlan)  # CPUs and threads of each local rank
    max_restarts: int = 0  # restarts of the whole group after a failure a restart can cure (supervisor.py)
    preempt_signal: int | None = None  # the pre-emption signal: checkpoint, stop, requeue the SLURM job

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


def started_externally(environ: Any) -> bool:
    if all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return True  # torchrun / torch.distributed.run
    return "SLURM_JOB_ID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ


def _check_port_free(addr: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError as err:
            raise ConfigError(
                f"--master-port {port} is already in use on this machine ({err.strerror}); another job (or an "
                "earlier run that is still alive) is listening there. Pick another port, or leave --master-port "
                "out on a single node so a private rendezvous is used."
            ) from None


def make_plan(cfg: DistConfig) -> LaunchPlan:
    """Decide backend, process count, GPUs and rendezvous from ``cfg`` and this machine; sets GPU env vars.

    Raises ConfigError for every impossible request, before anything is spawned.
    """
    from ignite_mgpu.processes import gpus

    environ = os.environ
    gpu_plan = None
    if started_externally(environ):
        if cfg.nproc is not None or (cfg.gpus or "").startswith("auto"):
            raise ConfigError(
                "this process was started by torchrun/SLURM, which decides the processes: drop --nproc, and choose "
                "GPUs with physical ids (--gpus 2,3) or CUDA_VISIBLE_DEVICES, not --gpus auto (each process would "
                "choose on its own)."
            )
        if cfg.max_restarts:
            raise ConfigError(
                f"--max-restarts {cfg.max_restarts}: this process was started by torchrun/SLURM, which starts (and "
                "restarts) the processes; one of them cannot restart the others. Let the outer launcher restart the "
                "job and resume it: torchrun --max-restarts N ... train --resume auto, or sbatch --requeue with "
                "--resume auto; and drop --max-restarts."
            )
    if cfg.gpus is not None:
        gpu_plan = gpus.plan_gpus(cfg.gpus, gpus.query_gpus(), environ, cfg.nproc)
        gpus.check_cuda_not_initialized(gpu_plan.physical_ids, environ)
        # Before torch.cuda is asked anything: CUDA reads CUDA_VISIBLE_DEVICES once, at initialisation.
        environ.update(gpu_plan.env)
    import torch

    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if n_cuda else "gloo"
    if backend == "nccl" and not n_cuda:
        raise ConfigError(
            "--backend nccl needs CUDA, but no GPU is visible to PyTorch here. Use --backend gloo (CPU) or "
            "--backend auto, or check CUDA_VISIBLE_DEVICES and the driver (ignite-mgpu devices)."
        )
    if gpu_plan is not None and gpu_plan.physical_ids and not n_cuda:
        built = "without CUDA" if torch.version.cuda is None else f"for CUDA {torch.version.cuda}"
        raise ConfigError(
            f"--gpus {cfg.gpus} selects GPUs that nvidia-smi shows, but PyTorch sees no CUDA device (torch "
            f"{torch.__version__}, built {built}); the job would silently train on the CPU. Install a CUDA build of "
            "PyTorch that matches the driver, or pass --gpus none to train on the CPU."
        )
    messages = list(gpu_plan.messages) if gpu_plan else []
    if cfg.strategy == "dp":
        if not n_cuda:
            raise ConfigError("--strategy dp (nn.DataParallel) needs GPUs; on the CPU use the default --strategy ddp.")
        if (cfg.nproc or 1) != 1 or cfg.nnodes != 1:
            raise ConfigError("--strategy dp runs ONE process that drives every selected GPU; drop --nproc/--nnodes.")
    if started_externally(environ):
        return _external_plan(cfg, backend, n_cuda, messages, environ)
    selected = len(gpu_plan.physical_ids) if gpu_plan and gpu_plan.physical_ids else n_cuda
    nproc = cfg.nproc if cfg.nproc is not None else (selected if selected and cfg.strategy != "dp" else 1)
    if cfg.strategy == "fsdp":
        _check_fsdp_processes(cfg, nproc, gpu_plan.physical_ids if gpu_plan else None, messages)
    if backend == "nccl" and nproc > n_cuda:
        raise ConfigError(
            f"--nproc {nproc} with nccl needs {nproc} GPUs, but {n_cuda} {'is' if n_cuda == 1 else 'are'} visible; "
            "NCCL cannot put two ranks on one GPU. Use --nproc "
            f"{n_cuda}, select more GPUs with --gpus, or use --backend gloo."
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
        strategy=cfg.strategy,
        gpus=gpu_plan.physical_ids if gpu_plan else None,
        device="cuda" if n_cuda else "cpu",
        # CUDA reads CUDA_VISIBLE_DEVICES once, when this process first asks it anything (torch.cuda.is_available()
        # included, without is_initialized() turning true), and this process may have asked before --gpus was
        # applied: a job on chosen GPUs always runs in a spawned process, also a single one.
        # A restart needs a process to restart: one process with --max-restarts runs in a spawned worker too.
        spawn_one=(gpu_plan is not None and bool(gpu_plan.physical_ids)) or cfg.max_restarts > 0,
        messages=messages,
        max_restarts=cfg.max_restarts,
        preempt_signal=scheduler.signal_number(cfg.preempt_signal),
    )
    if plan.backend is not None:
        if cfg.master_port is not None and cfg.node_rank == 0:
            _check_port_free(cfg.master_addr, cfg.master_port)
        if cfg.nnodes == 1:
            # Keep gloo/NCCL's own sockets on loopback: nothing of a single-node job listens on the network.
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if var not in environ and any(name == "lo" for _, name in socket.if_nameindex()):
                    plan.env[var] = "lo"
        if backend == "gloo" and 0 < n_cuda < nproc and gpu_plan is None:
            # ignite puts rank k on cuda:k whenever CUDA is visible; with more ranks than GPUs, train on the CPU.
            plan.env["CUDA_VISIBLE_DEVICES"] = ""
            plan.device = "cpu"
            plan.messages.append(f"--backend gloo with {nproc} processes and {n_cuda} GPU(s): training on the CPU.")
        if backend == "gloo" and "OMP_NUM_THREADS" not in environ:
            plan.env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))  # no oversubscription
    on_gpu = bool(n_cuda) and plan.env.get("CUDA_VISIBLE_DEVICES") != ""
    plan.binding = plan_for_job(cfg.cpu_binding, nproc, plan.gpus, on_gpu, cfg.strategy, environ)
    return plan


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
    world = int(environ.get("WORLD_SIZE", environ.get("SLURM_NTASKS", "1")))
    nproc = int(environ.get("LOCAL_WORLD_SIZE", environ.get("SLURM_NTASKS_PER_NODE", str(world))).split("(")[0])
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
        strategy=cfg.strategy,
        external=True,
        device="cuda" if n_cuda else "cpu",
        messages=messages,
        binding=plan_for_job(cfg.cpu_binding, nproc, None, False, cfg.strategy, environ, external=True),
        preempt_signal=scheduler.signal_number(cfg.preempt_signal),
    )


def run_plan(
    plan: LaunchPlan, fn: Callable[..., Any], *args: Any, restart: Callable[[int], Restart] | None = None
) -> int:
    """Run ``fn(local_rank, *args)`` as the plan says; returns the job's exit code (errors.EXIT_CODES).

    ``restart(k)`` gives the arguments of restart k (``plan.max_restarts``; without it ``fn`` runs again with
    ``args``). After a stop on the pre-emption signal, global rank 0 requeues the SLURM job.
    """
    for line in plan.messages:
        print(f"ignite-mgpu: {line}", file=sys.stderr)
    first = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    if plan.binding.reason and first:  # once per job
        print(f"ignite-mgpu: {plan.binding.reason}", file=sys.stderr)
    if plan.external or (plan.backend is None and not plan.spawn_one):
        code = _run_here(plan, fn, args)
    else:
        code = Supervisor(plan, fn, args, restart).run()
        first = plan.node_rank == 0
    if plan.preempt_signal and code == signal_exit_code(plan.preempt_signal) and first:
        print(f"ignite-mgpu: {scheduler.requeue()}", file=sys.stderr, flush=True)
    return code


def _run_here(plan: LaunchPlan, fn: Callable[..., Any], args: tuple) -> int:
    """One process of the job in this process: a one-process job, or one that torchrun / srun started."""
    unbind = apply_binding(plan.binding.rank(int(os.environ.get("LOCAL_RANK", "0"))))  # restored after the job
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
) -> None:
    """Run ``fn(local_rank, *args)`` in ``nproc`` processes per node inside ``ignite.distributed.Parallel``.

    ``backend="auto"`` is nccl with CUDA, else gloo; ``nproc`` defaults to the selected GPUs, or 1 on the CPU.
    Under torchrun / SLURM it spawns nothing and joins the group. On one node without ``master_port`` the
    rendezvous is a private file store (no TCP port, so two jobs never collide). ``gpus`` takes physical ids
    ("2,3"), "all", "none", "auto" or "auto:N". ``cpu_binding`` (auto, none, cores, numa) binds each process to its
    CPUs and sets its intra-op threads (README: the --cpu-binding flag). ``max_restarts``: after a failure a
    restart can cure (a crash, a killed rank, a collective timeout), every process is stopped and ``fn`` runs again
    from its start, up to that many times; the job must resume from its own checkpoints.

    Raises:
        ConfigError: an impossible request (bad nproc, nccl without GPUs, busy master_port), before spawning.
        SystemExit: with the job's exit code when a rank failed (1), the loss diverged (3) or on SIGINT/SIGTERM
            (130/143); the failing rank's error has been printed once.
    """
    from ignite_mgpu.config import Config, validate

    if backend not in ("auto", "nccl", "gloo") or strategy not in ("ddp", "dp", "fsdp"):
        raise ConfigError(f"backend={backend!r} / strategy={strategy!r}: use auto|nccl|gloo and ddp|dp|fsdp.")
    if cpu_binding not in ("auto", "none", "cores", "numa"):
        raise ConfigError(f"cpu_binding={cpu_binding!r}: use auto, none, cores or numa.")
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
    )
    validate(Config(dist=dist_cfg))
    code = run_plan(make_plan(dist_cfg), fn, *args)
    if code:
        raise SystemExit(code)
