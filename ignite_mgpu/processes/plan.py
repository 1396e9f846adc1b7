"""The launch plan: backend, processes, GPUs, rendezvous, CPU binding and restarts, decided once in the parent
before anything is spawned (``make_plan``), and never changed after: a frozen ``LaunchPlan``. A job on other GPUs
(an elastic job's change of size) runs on a new plan made from it (``LaunchPlan.on_gpus``).

Deciding is a pure function of the config, the GPU snapshot and a few facts about this machine (``decide``,
``machine.py``). Torch-free at import: torch is asked how many CUDA devices it sees, once, when the plan is made.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.cpus.binding import BindingPlan, plan_for_job
from ignite_mgpu.env import cluster
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import acquire, selection
from ignite_mgpu.gpus.claims import GpuClaims
from ignite_mgpu.gpus.ranges import GpuRange, gpu_range
from ignite_mgpu.processes import machine
from ignite_mgpu.processes.machine import Machine, check_devices, check_outer_launcher, check_port_free


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the supervisor and the workers need, decided once in the parent. What changes while a job runs
    (its GPU claims, each attempt's rendezvous and clock) is the job's, never the plan's."""

    backend: str | None  # "nccl", "gloo", or None for a single process without a process group
    nproc: int  # processes on this node
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one node: a private file store (or, for a script, a free port)
    env: Mapping[str, str] = field(default_factory=dict)  # set in every worker before torch starts
    timeout: float = 300.0  # dist.timeout: every process group of the job is made with it
    stop_grace: float = 60.0
    hang_seconds: float = 60.0  # the hang watch's shortest window (hangs/watch.py; 0: off)
    strategy: str = "ddp"
    external: bool = False  # started by torchrun / SLURM: join, spawn nothing
    # Physical GPU ids in CUDA order (None: as the environment has them)
    gpus: list[int] | None = None
    gpu_names: Mapping[int, str] = field(default_factory=dict)  # physical id -> its claim name (UUID), to find it again
    # --gpus auto:MIN-MAX: the restart leaves out a lost GPU, not below MIN; the job lends GPUs (elastic.py)
    gpu_range: GpuRange | None = None
    # The backend of the job's process group, also while one process needs none (a range that may grow).
    group_backend: str = "gloo"
    # dist.min_free_memory: a GPU with less free is not free for an elastic job to take (elastic.py)
    min_free_memory: float = 0.0
    # The CPUs that OMP_NUM_THREADS divides among the processes when the plan set it (0: the user's or unset).
    cpu_share: int = 0
    device: str = "cpu"  # what the workers train on: "cuda" or "cpu"
    messages: tuple[str, ...] = ()  # said once when the job starts
    binding: BindingPlan = field(default_factory=BindingPlan)  # CPUs and threads of each local rank
    # Restarts of the whole group after a failure a restart can cure (supervisor.py)
    max_restarts: int = 0
    # The pre-emption signal: checkpoint, stop, requeue the SLURM job.
    preempt_signal: int | None = None
    # "forkserver" (forkserver.py): a job joining the group; "spawn": a user's script (ignite-mgpu run), started
    # in a fresh interpreter as python would run it; "fork": from a notebook (its function, a fresh process cannot
    # import).
    start_method: str = "spawn"
    rank_prefix: bool = False  # each line a worker writes begins with its global rank (relay.py)
    # False: the job creates its own process group (ignite-mgpu run: a user's script)
    join_group: bool = True
    # TORCHELASTIC_RUN_ID of the workers (cluster.run_id): is_torchelastic_launched() is True, as under torchrun
    run_id: str = "none"

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def spawn_one(self) -> bool:
        """Whether even one process runs in a worker: on chosen GPUs (CUDA reads CUDA_VISIBLE_DEVICES once, at this
        process's first question, maybe asked before --gpus was applied), with restarts (a process to restart), a
        script (its workers get the torchrun environment, this process supervises)."""
        return bool(self.gpus) or self.max_restarts > 0 or not self.join_group

    @property
    def first_rank(self) -> int:
        """The global rank of this node's local rank 0."""
        return self.node_rank * self.nproc

    def on_gpus(self, names: Mapping[int, str]) -> LaunchPlan:
        """This plan on the GPUs ``names`` (physical id -> claim name): one process each (one in all for ``dp``),
        the group's backend when there are several, the threads and the CPU binding planned again for them. The
        workers find their GPUs by UUID (``GPU-...``), where the claim names one: after a GPU fell off the bus, the
        others' indices may not be CUDA's any more."""
        ids = sorted(names)
        visible = [names[i] if names[i].startswith("GPU-") else str(i) for i in ids]
        env = {**self.env, "CUDA_VISIBLE_DEVICES": ",".join(visible)}
        return self._resized(1 if self.strategy == "dp" else len(ids), env, ids, dict(sorted(names.items())))

    def with_processes(self, nproc: int) -> LaunchPlan:
        """This plan with ``nproc`` processes on this node, on the CPU or on the GPUs as the environment has them
        (local rank k on cuda:k); the threads and the CPU binding planned again. For chosen GPUs: ``on_gpus``."""
        return self._resized(nproc, dict(self.env), self.gpus, dict(self.gpu_names))

    def _resized(self, nproc: int, env: dict[str, str], gpus: list[int] | None, names: dict[int, str]) -> LaunchPlan:
        if self.cpu_share:  # OMP_NUM_THREADS is the plan's: the CPUs shared by the new number of processes
            env["OMP_NUM_THREADS"] = str(max(1, self.cpu_share // nproc))
        binding = self.binding
        if binding.mode != "none":
            try:
                binding = plan_for_job(binding.mode, nproc, gpus, self.device == "cuda", self.strategy, os.environ)
            except ConfigError:
                binding = BindingPlan()  # the new size cannot be bound as asked: unbound, as --cpu-binding none
        return dataclasses.replace(
            self,
            gpus=gpus,
            nproc=nproc,
            backend=(self.backend or self.group_backend) if nproc * self.nnodes > 1 else None,
            env=env,
            gpu_names=names,
            binding=binding,
        )


def make_plan(
    cfg: DistConfig, environ: dict[str, str] | os._Environ[str] = os.environ, join_group: bool = True
) -> tuple[LaunchPlan, GpuClaims]:
    """Decide backend, process count, GPUs and rendezvous from ``cfg`` and this machine; returns the plan and the
    GPU claims of the job (``acquire.py``), which the caller holds while the job runs (``with claims:``). A job
    that torchrun or SLURM started, or on the CPU, claims nothing.

    The chosen GPUs' environment (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER) is the one change to ``environ``, made
    before torch is asked anything: CUDA reads it once, when this process first asks. Everything else the plan
    sets (``plan.env``) is applied in the workers. ``join_group=False``: a script that creates its own process
    group from the torchrun environment (``script.py``), on whichever backend it chooses.

    Raises:
        ConfigError: every impossible request, before anything is spawned (the claims are then let go).
    """
    check_outer_launcher(cfg, environ)
    external = cluster.started_externally(environ)
    gpu_plan, held = None, GpuClaims()
    try:
        if cfg.gpus is not None:
            gpu_plan, held = acquire.acquire(cfg, environ, claim=not external)
            selection.check_cuda_not_initialized(gpu_plan.physical_ids, environ)
            environ.update(gpu_plan.env)
        plan = decide(cfg, gpu_plan, machine.probe_machine(), environ, join_group)
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
    return dataclasses.replace(plan, binding=binding, run_id=cluster.run_id(environ, cfg.nnodes)), held


def decide(
    cfg: DistConfig,
    gpu_plan: selection.GpuPlan | None,
    facts: Machine,
    environ: Mapping[str, str],
    join_group: bool = True,
) -> LaunchPlan:
    """The plan without its CPU binding: a pure function of the config, the chosen GPUs, the machine and the
    launcher's environment (read only). A script (``join_group=False``) chooses its own backend: the checks of
    ours (nccl needs a GPU per process) are its to make."""
    n_cuda = facts.cuda_devices
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if n_cuda else "gloo")
    check_devices(cfg, backend, gpu_plan, facts)
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
    grows = gpu_range(cfg.gpus)
    in_group = nproc * cfg.nnodes > 1 or (grows is not None and grows.high > 1)  # a range may grow from one
    group = _group_environment(cfg.nnodes, nproc, backend, n_cuda, gpu_plan is None and join_group, facts, environ)
    env, device, cpu_share, note = group if in_group else ({}, "cuda" if n_cuda else "cpu", 0, None)
    return LaunchPlan(
        backend=backend if nproc * cfg.nnodes > 1 else None,
        nproc=nproc,
        nnodes=cfg.nnodes,
        node_rank=cfg.node_rank,
        master_addr=cfg.master_addr,
        master_port=cfg.master_port,
        env=env,
        timeout=cfg.timeout,
        stop_grace=cfg.stop_grace,
        hang_seconds=cfg.hang_seconds,
        strategy=cfg.strategy,
        gpus=chosen,
        gpu_names=dict(gpu_plan.names) if gpu_plan else {},
        gpu_range=grows,
        group_backend=backend,
        min_free_memory=cfg.min_free_memory,
        cpu_share=cpu_share,
        device=device,
        messages=(*messages, *([note] if note else [])),
        max_restarts=cfg.max_restarts,
        preempt_signal=cluster.signal_number(cfg.preempt_signal),
        join_group=join_group,
        start_method="forkserver" if join_group else "spawn",
        rank_prefix=cfg.rank_prefix,
    )


def _group_environment(
    nnodes: int,
    nproc: int,
    backend: str,
    n_cuda: int,
    gpus_as_found: bool,
    facts: Machine,
    environ: Mapping[str, str],
) -> tuple[dict[str, str], str, int, str | None]:
    """The workers' environment for a process group: loopback sockets on one node, CPU threads per process. Returns
    (the environment, the device they train on, the CPUs that OMP_NUM_THREADS divides, a note for the user)."""
    env: dict[str, str] = {}
    device = "cuda" if n_cuda else "cpu"
    cpu_share, note = 0, None
    if nnodes == 1:
        # Keep gloo/NCCL's own sockets on loopback: nothing of a single-node job listens on the network.
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if var not in environ and facts.loopback:
                env[var] = "lo"
    if backend == "gloo" and 0 < n_cuda < nproc and gpus_as_found:
        # ignite puts rank k on cuda:k whenever CUDA is visible; with more ranks than GPUs, train on the CPU.
        env["CUDA_VISIBLE_DEVICES"] = ""
        device = "cpu"
        note = f"--backend gloo with {nproc} processes and {n_cuda} GPU(s): training on the CPU."
    if backend == "gloo" and "OMP_NUM_THREADS" not in environ:
        # Each process's intra-op threads get its share of the CPUs, not every core (no oversubscription).
        cpu_share = facts.cpu_count
        env["OMP_NUM_THREADS"] = str(max(1, facts.cpu_count // nproc))
    return env, device, cpu_share, note


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
        messages=tuple(messages),
        preempt_signal=cluster.signal_number(cfg.preempt_signal),
    )
