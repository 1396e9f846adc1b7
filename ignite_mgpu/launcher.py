"""Processes: the launch plan (backend, nproc, GPUs, rendezvous) and a small supervisor that spawns one worker
per process, runs ``fn(local_rank, *args)`` inside ``idist.Parallel`` there, and turns failures into exit codes.

Exit codes: 0 success, 1 a rank failed, 2 usage/config error before spawning, 3 non-finite loss, 130 SIGINT,
143 SIGTERM. Under torchrun or SLURM nothing is spawned: the process joins the existing group.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from ignite_mgpu.config import ConfigError, DistConfig

logger = logging.getLogger("ignite_mgpu")


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
    messages: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


def _started_externally(environ: Any) -> bool:
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
    from ignite_mgpu import gpus

    environ = os.environ
    gpu_plan = None
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
    messages = list(gpu_plan.messages) if gpu_plan else []
    if cfg.strategy == "dp":
        if not n_cuda:
            raise ConfigError("--strategy dp (nn.DataParallel) needs GPUs; on the CPU use the default --strategy ddp.")
        if (cfg.nproc or 1) != 1 or cfg.nnodes != 1:
            raise ConfigError("--strategy dp runs ONE process that drives every selected GPU; drop --nproc/--nnodes.")
    external = _started_externally(environ)
    if external:
        nproc = int(environ.get("LOCAL_WORLD_SIZE", environ.get("SLURM_NTASKS_PER_NODE", "1")).split("(")[0])
        return LaunchPlan(
            backend,
            nproc,
            timeout=cfg.timeout,
            stop_grace=cfg.stop_grace,
            strategy=cfg.strategy,
            external=True,
            messages=messages,
        )
    selected = len(gpu_plan.physical_ids) if gpu_plan and gpu_plan.physical_ids else n_cuda
    nproc = cfg.nproc if cfg.nproc is not None else (selected if selected and cfg.strategy == "ddp" else 1)
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
        messages=messages,
    )
    if plan.backend is not None:
        if cfg.master_port is not None and cfg.node_rank == 0:
            _check_port_free(cfg.master_addr, cfg.master_port)
        if cfg.nnodes == 1:
            # Keep gloo/NCCL's own sockets on loopback: nothing of a single-node job listens on the network.
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if var not in environ and any(name == "lo" for _, name in socket.if_nameindex()):
                    plan.env[var] = "lo"
        if backend == "gloo" and "OMP_NUM_THREADS" not in environ:
            plan.env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))  # no oversubscription
    return plan


# ----------------------------------------------------------------------------------------------- workers


def _run_in_group(plan: LaunchPlan, fn: Callable[..., Any], args: tuple) -> None:
    import ignite.distributed as idist

    from ignite_mgpu import handlers

    handlers.set_collective_timeout(plan.timeout)
    for name in ("launcher.Parallel", "auto.auto_dataloader", "auto.auto_model", "auto.auto_optim"):
        logging.getLogger(f"ignite.distributed.{name}").setLevel(logging.WARNING)  # ignite keeps existing loggers
    with idist.Parallel(backend=plan.backend, init_method=plan.init_method) as parallel:
        if plan.gpus is not None and idist.device().type == "cuda":
            import torch

            index = idist.device().index or 0
            print(
                f"rank {idist.get_rank()}: cuda:{index} is physical GPU {plan.gpus[index]} "
                f"({torch.cuda.get_device_name(index)})",
                file=sys.stderr,
                flush=True,
            )
        parallel.run(fn, *args)


def _on_signal(signum: int, frame: Any) -> None:
    from ignite_mgpu import handlers

    if signum == signal.SIGINT and handlers._stop_signal:
        raise KeyboardInterrupt  # second Ctrl-C: stop at once
    handlers.request_stop(signum)


def _set_pdeathsig() -> None:
    # If the launcher dies (even by SIGKILL), its workers die too instead of holding GPUs and ports.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _is_user_error(err: BaseException) -> bool:
    """Errors whose message says it all (bad checkpoint, config, a deliberate stop): no traceback."""
    from ignite_mgpu.checkpoint import CheckpointError
    from ignite_mgpu.handlers import TrainingStopped

    return isinstance(err, (ConfigError, CheckpointError, TrainingStopped))


def _worker(local_rank: int, plan: LaunchPlan, fn: Callable[..., Any], args: tuple, error_dir: str) -> None:
    _set_pdeathsig()
    os.setpgid(0, 0)  # own process group: Ctrl-C reaches only the launcher, which then stops the workers
    rank = plan.node_rank * plan.nproc + local_rank
    os.environ.update(plan.env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(plan.world_size),
        LOCAL_WORLD_SIZE=str(plan.nproc),
        GROUP_RANK=str(plan.node_rank),
        MASTER_ADDR=plan.master_addr,
        MASTER_PORT=str(plan.master_port or 29500),
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_signal)
    code = 0
    try:
        _run_in_group(plan, fn, args)
    except BaseException as err:  # noqa: BLE001 - every failure becomes an error file and an exit code
        from ignite_mgpu.handlers import TrainingStopped

        code = err.exit_code if isinstance(err, TrainingStopped) else 1
        report = {
            "rank": rank,
            "time": time.time(),
            "type": type(err).__name__,
            "message": str(err),
            "traceback": "" if _is_user_error(err) else traceback.format_exc(),
            "code": code,
        }
        Path(error_dir, f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a broken process group must not hang the exit


# ----------------------------------------------------------------------------------------------- supervisor


FAILURE_GRACE = 10.0  # seconds the other ranks get to notice a failed rank before they are killed


class _Supervisor:
    """Starts the workers, watches them, stops them all on the first failure or a signal."""

    def __init__(self, plan: LaunchPlan, fn: Callable[..., Any], args: tuple) -> None:
        self.plan, self.fn, self.args = plan, fn, args
        self.error_dir = tempfile.mkdtemp(prefix="ignite-mgpu-")  # 0700: private to this user
        self.signal_received = 0
        self.procs: list[Any] = []
        self.first_exit: tuple[int, int] | None = None  # (local rank, exit code) of the first rank that failed

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if not p.pid:
                continue
            if sig == signal.SIGKILL:
                # The worker's group holds its data-loader workers, and outlives a worker that already exited
                # (os._exit leaves them orphaned until their watchdog notices, about 5 s later).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, sig)  # also before the worker made its own group

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signal_received:  # second signal: no more waiting
            self._signal_all(signal.SIGKILL)
            raise KeyboardInterrupt
        self.signal_received = signum
        print(
            f"ignite-mgpu: {signal.Signals(signum).name} received: stopping every rank at the next check "
            f"(up to {self.plan.stop_grace:.0f} s); press Ctrl-C again to stop at once.",
            file=sys.stderr,
        )
        self._signal_all(signal.SIGTERM)
        self.deadline = time.monotonic() + self.plan.stop_grace

    def run(self) -> int:
        ctx = mp.get_context("spawn")
        plan = self.plan
        if plan.nnodes == 1 and plan.master_port is None:
            plan.init_method = "file://" + os.path.join(self.error_dir, "rendezvous")  # no TCP port at all
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.deadline = float("inf")
        self.failure_deadline = float("inf")
        try:
            for local_rank in range(plan.nproc):
                p = ctx.Process(
                    target=_worker,
                    args=(local_rank, plan, self.fn, self.args, self.error_dir),
                    name=f"ignite-mgpu-rank{local_rank}",
                )
                p.start()
                self.procs.append(p)
            self._watch()
        except KeyboardInterrupt:
            pass
        finally:
            self._signal_all(signal.SIGKILL)
            for p in self.procs:
                p.join(5)
            for s, h in old.items():
                signal.signal(s, h)
        code = self._report()
        shutil.rmtree(self.error_dir, ignore_errors=True)
        return code

    def _watch(self) -> None:
        alive = {p.sentinel: p for p in self.procs}
        while alive:
            for sentinel in wait(list(alive), timeout=0.5):
                p = alive.pop(sentinel)
                p.join()
                if p.exitcode != 0 and self.first_exit is None:
                    self.first_exit = (self.procs.index(p), p.exitcode)
                if p.exitcode != 0 and not self.signal_received and self.failure_deadline == float("inf"):
                    # One rank failed: the others cannot finish. With gloo their next collective fails at once
                    # ("Connection closed by peer") and they exit by themselves, after a checkpoint they are
                    # writing has landed; whatever still runs after the grace (NCCL may hang) is killed.
                    self.failure_deadline = time.monotonic() + FAILURE_GRACE
            if time.monotonic() > self.failure_deadline:
                self._signal_all(signal.SIGKILL)
                self.failure_deadline = float("inf")
            if time.monotonic() > self.deadline:
                print(
                    f"ignite-mgpu: workers did not stop within {self.plan.stop_grace:.0f} s; killing them.",
                    file=sys.stderr,
                )
                self._signal_all(signal.SIGKILL)
                self.deadline = float("inf")

    def _report(self) -> int:
        reports = []
        for f in Path(self.error_dir).glob("rank*.json"):
            with contextlib.suppress(ValueError, OSError):
                reports.append(json.loads(f.read_text()))
        codes = [p.exitcode for p in self.procs]
        if self.signal_received:
            stopped = [r for r in reports if r["code"] in (130, 143)]
            # The workers were told with SIGTERM; name the signal the user actually sent.
            name = signal.Signals(self.signal_received).name
            message = stopped[0]["message"].replace("SIGTERM", name) if stopped else f"stopped by {name}"
            print(f"ignite-mgpu: {message}.", file=sys.stderr)
            return 128 + self.signal_received
        if all(c == 0 for c in codes):
            return 0
        diverged = [r for r in reports if r["code"] == 3]
        if diverged:
            print(f"ignite-mgpu: training diverged: {diverged[0]['message']}", file=sys.stderr)
            return 3
        return self._report_failure(reports, codes)

    def _report_failure(self, reports: list[dict], codes: list[int | None]) -> int:
        offset = self.plan.node_rank * self.plan.nproc
        if self.first_exit and self.first_exit[1] < 0:  # killed (OOM killer, kill -9): no error file of its own
            i, c = self.first_exit
            name = signal.Signals(-c).name
            hint = " (the kernel's OOM killer sends SIGKILL when memory runs out)" if c == -9 else ""
            print(
                f"ignite-mgpu: rank {offset + i} terminated with signal {name}{hint}; stopped the other "
                "ranks. Resume from the last checkpoint with --resume auto.",
                file=sys.stderr,
            )
            return 1
        failed = [r for r in reports if r["code"] == 1]
        timeouts = [r for r in failed if "timed out" in r["message"].lower() or "timeout" in r["type"].lower()]
        if failed and len(timeouts) == len(failed):
            waiting = {r["rank"] for r in timeouts}
            silent = [offset + i for i in range(self.plan.nproc) if offset + i not in waiting]
            first = min(timeouts, key=lambda r: r["time"])
            print(
                f"ignite-mgpu: rank {first['rank']} timed out after {self.plan.timeout:.0f} s (dist.timeout) "
                f"waiting in a collective; rank(s) {', '.join(map(str, silent)) or '?'} stopped answering "
                f"(stuck or hung). Error: {first['message'].splitlines()[0] if first['message'] else ''}",
                file=sys.stderr,
            )
            return 1
        if failed:
            # The earliest error is the cause; later ones are usually peers losing their connection to it.
            first = min(failed, key=lambda r: r["time"])
            print(f"ignite-mgpu: rank {first['rank']} failed with {first['type']}: {first['message']}", file=sys.stderr)
            print(first["traceback"], file=sys.stderr, end="")
            return 1
        print(f"ignite-mgpu: a rank exited with codes {codes}.", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _in_process_signals() -> Iterator[None]:
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_plan(plan: LaunchPlan, fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(local_rank, *args)`` as the plan says; returns the job's exit code (see module docstring)."""
    for line in plan.messages:
        print(f"ignite-mgpu: {line}", file=sys.stderr)
    if plan.external or plan.backend is None:
        # Training runs in this process, which needs ignite anyway; a parent that spawns workers never imports it.
        from ignite_mgpu.handlers import TrainingStopped

        with _in_process_signals():
            try:
                _run_in_group(plan, fn, args)
            except TrainingStopped as err:
                print(f"ignite-mgpu: {err}", file=sys.stderr)
                return err.exit_code
            except Exception as err:
                if not _is_user_error(err):
                    raise
                print(f"ignite-mgpu: {type(err).__name__}: {err}", file=sys.stderr)
                return 1
        return 0
    return _Supervisor(plan, fn, args).run()


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
) -> None:
    """Run ``fn(local_rank, *args)`` in ``nproc`` processes per node inside ``ignite.distributed.Parallel``.

    ``backend="auto"`` is nccl with CUDA, else gloo; ``nproc`` defaults to the selected GPUs, or 1 on the CPU.
    Under torchrun / SLURM it spawns nothing and joins the group. On one node without ``master_port`` the
    rendezvous is a private file store (no TCP port, so two jobs never collide). ``gpus`` takes physical ids
    ("2,3"), "all", "none", "auto" or "auto:N".

    Raises:
        ConfigError: an impossible request (bad nproc, nccl without GPUs, busy master_port), before spawning.
        SystemExit: with the job's exit code when a rank failed (1), the loss diverged (3) or on SIGINT/SIGTERM
            (130/143); the failing rank's error has been printed once.
    """
    from ignite_mgpu.config import Config, validate

    if backend not in ("auto", "nccl", "gloo") or strategy not in ("ddp", "dp"):
        raise ConfigError(f"backend={backend!r} / strategy={strategy!r}: use auto|nccl|gloo and ddp|dp.")
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
    )
    validate(Config(dist=dist_cfg))
    code = run_plan(make_plan(dist_cfg), fn, *args)
    if code:
        raise SystemExit(code)
