"""The process supervisor: one spawned worker per local rank, each running ``fn`` inside ``idist.Parallel``; the
first failure or a signal stops them all, and the outcome becomes one exit code and one message."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ignite_mgpu.config import ConfigError

if TYPE_CHECKING:
    from ignite_mgpu.launcher import LaunchPlan


def run_in_group(plan: LaunchPlan, fn: Callable[..., Any], args: tuple) -> None:
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


def is_user_error(err: BaseException) -> bool:
    """Errors whose message says it all (bad checkpoint, config, a deliberate stop): no traceback."""
    from ignite_mgpu.checkpoint import CheckpointError
    from ignite_mgpu.handlers import TrainingStopped

    return isinstance(err, (ConfigError, CheckpointError, TrainingStopped))


def _worker(local_rank: int, plan: LaunchPlan, fn: Callable[..., Any], args: tuple, error_dir: str) -> None:
    _set_pdeathsig()
    os.setpgid(0, 0)  # own process group: Ctrl-C reaches only the launcher, which then stops the workers
    for var in [v for v in os.environ if v.startswith("SLURM_")]:
        del os.environ[var]  # inside an allocation ignite would read the launcher's SLURM task, not this rank
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
        run_in_group(plan, fn, args)
    except BaseException as err:  # noqa: BLE001 - every failure becomes an error file and an exit code
        from ignite_mgpu.handlers import TrainingStopped

        code = err.exit_code if isinstance(err, TrainingStopped) else 1
        report = {
            "rank": rank,
            "time": time.time(),
            "type": type(err).__name__,
            "message": str(err),
            "traceback": "" if is_user_error(err) else traceback.format_exc(),
            "code": code,
        }
        Path(error_dir, f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a broken process group must not hang the exit


# ----------------------------------------------------------------------------------------------- supervisor


FAILURE_GRACE = 10.0  # seconds the other ranks get to notice a failed rank before they are killed


class Supervisor:
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
        self.deadline = float("inf")
        self.failure_deadline = float("inf")
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for local_rank in range(plan.nproc):
                if self.signal_received:
                    break  # stopped while starting: start no more workers
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
        stopped = [r for r in reports if r["code"] in (130, 143)]
        if len(stopped) == len(self.procs):  # every worker was signalled directly (e.g. by a scheduler)
            print(f"ignite-mgpu: {stopped[0]['message']}.", file=sys.stderr)
            return int(stopped[0]["code"])
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
def in_process_signals() -> Iterator[None]:
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
