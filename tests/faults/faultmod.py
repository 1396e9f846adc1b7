"""Test-only fault injection for ``tests/faults``: a tiny model whose forward misbehaves on request.

Passed to the real CLI as ``model.name=faultmod:make`` (``tests/faults`` on ``PYTHONPATH``), so the product
needs no hooks. Environment variables, read in every worker:

``FAULT``
    Comma-separated ``kind:rank:iteration[:arg]`` entries. ``rank`` is a global rank or ``*`` (every rank);
    ``iteration`` counts the training-mode forward calls of this process, starting at 1 (with
    ``grad_accum_steps=1`` that is the trainer iteration of a fresh run). Kinds:

    - ``raise``: ``RuntimeError("boom")`` in forward.
    - ``sleep``: sleep for an hour (a hung rank).
    - ``pause``: sleep ``arg`` seconds (default 5) in that forward only (a long compilation of the first step).
    - ``kill``: ``SIGKILL`` this process.
    - ``losegpu``: this rank's GPU falls off the bus, as the tools report it: the stand-in nvidia-smi
      (tests/fake_gpus) reports it lost (its bus id is added to ``$FAKE_NVIDIA_SMI_DIR/lost.csv``: nvidia-smi then
      prints the other rows, "Unable to determine the device handle for GPU...: GPU is lost" and exits 15; the GPU
      is ``CUDA_VISIBLE_DEVICES``'s entry ``LOCAL_RANK``, an index or a UUID); then the rank writes what NCCL's
      watchdog writes of it and aborts (SIGABRT, no Python clean-up, no failure file), as the watchdog does.
    - ``deverror``: ``RuntimeError("CUDA error: unspecified launch failure")`` in forward, what a rank whose GPU
      failed raises (the GPU itself stays listed).
    - ``devassert``: a device-side assert (an index out of range inside a kernel), on the GPU a sticky CUDA error
      that every later CUDA call of the process repeats; on the CPU an ``IndexError``.
    - ``nan``: return NaN logits (a poisoned batch).
    - ``slow``: from that iteration on, sleep ``arg`` seconds (default 0.2) in every training forward.
    - ``hold``: wait in forward until ``PIDS_DIR/release`` exists (at most ``arg`` seconds, default 120): a job
      that is still running for as long as the test needs it, and no longer.
    - ``init``: ``RuntimeError("init boom")`` in the model constructor (``iteration`` is ignored).
    - ``slowsave``: from that iteration on, ``state_dict()`` writes ``PIDS_DIR/saving{RANK}`` and sleeps ``arg``
      seconds (default 3): a checkpoint that takes long to write, as a large model's does.
    - ``slowwrite``: from that iteration on, ``torch.save`` writes half of the file, flushes it, writes
      ``PIDS_DIR/halfwritten{RANK}``, sleeps ``arg`` seconds (default 60) and then writes the rest: a writer that
      can be killed mid-file.
    - ``nospace``: from that iteration on, ``torch.save`` into a file fails with ``OSError(ENOSPC)`` (a full disk).

    A kind prefixed with ``once-`` (``once-kill:1:5``) fires once per job: the first process to reach it writes
    ``PIDS_DIR/fired-<entry>``, and restarted processes (whose forward calls count from 1 again) skip it.

``PIDS_DIR``
    The constructor appends this process's pid to ``PIDS_DIR/rank{RANK}`` (one line per start: restarted ranks
    add theirs); at the second training forward it writes the pids of this process's children (DataLoader
    workers) to ``PIDS_DIR/children{RANK}``. Times (``time.time()``) for measurements: ``forward{RANK}`` gets a
    line "pid call time" at the first two training forwards of every process, ``fault{RANK}`` a line
    "kind time" just before a raise or kill.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _faults() -> list[tuple[str, str, int, float | None]]:
    faults = []
    for entry in filter(None, os.environ.get("FAULT", "").split(",")):
        kind, rank, iteration, *arg = entry.split(":")
        if kind.startswith("once-"):
            marker = Path(os.environ.get("PIDS_DIR", "."), f"fired-{entry.replace(':', '_')}")
            if marker.exists():
                continue
            kind = f"once:{marker}:{kind[len('once-') :]}"
        faults.append((kind, rank, int(iteration), float(arg[0]) if arg else None))
    return faults


def _fire(kind: str) -> str:
    """The kind to act on; a once-only fault marks itself fired first (a restarted process skips it)."""
    if kind.startswith("once:"):
        _, marker, kind = kind.split(":", 2)
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).write_text(str(os.getpid()))
    return kind


def _append(name: str, line: str) -> None:
    pids_dir = os.environ.get("PIDS_DIR")
    if pids_dir:
        Path(pids_dir).mkdir(parents=True, exist_ok=True)
        with Path(pids_dir, name).open("a") as f:
            f.write(line + "\n")


def _write(name: str, text: str) -> None:
    pids_dir = os.environ.get("PIDS_DIR")
    if pids_dir:
        Path(pids_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(pids_dir, f".{name}.tmp")
        tmp.write_text(text)
        tmp.replace(Path(pids_dir, name))  # readers never see a half-written file


# What NCCL's watchdog writes before it aborts a rank whose GPU fell off the bus (PyTorch 2.x, ProcessGroupNCCL).
WATCHDOG = (
    "[rank{rank}]:[E1204 10:41:07.512000000 ProcessGroupNCCL.cpp:1895] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] "
    "Process group watchdog thread terminated with exception: CUDA error: unknown error\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "terminate called after throwing an instance of 'c10::DistBackendError'\n"
    "  what():  [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Process group watchdog thread terminated with exception: "
    "CUDA error: unknown error\n"
)


def _lose_my_gpu() -> None:
    """This rank's GPU is reported lost by the stand-in (lost.csv written whole, then renamed: nvidia-smi never
    reads half); the rank writes the watchdog's lines and aborts."""
    mine = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[int(os.environ.get("LOCAL_RANK", "0"))]
    folder = Path(os.environ["FAKE_NVIDIA_SMI_DIR"])
    rows = [line.split(",") for line in (folder / "gpus.csv").read_text().splitlines()]
    (bus,) = [row[1].strip() for row in rows if mine in (row[0].strip(), row[-1].strip())]  # an index or a UUID
    lost = folder / "lost.csv"
    tmp = folder / ".lost.csv.tmp"
    tmp.write_text((lost.read_text() if lost.exists() else "") + f"{bus}\n")
    tmp.replace(lost)
    os.write(2, WATCHDOG.format(rank=_rank()).encode())
    os.abort()


def _hold(seconds: float) -> None:
    release, deadline = Path(os.environ["PIDS_DIR"], "release"), time.monotonic() + seconds
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class FaultyLinear(nn.Module):
    """A linear classifier over flattened ``3 x image_size x image_size`` images, with injected faults."""

    def __init__(self, num_classes: int, image_size: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * image_size * image_size, num_classes)
        self.calls = 0
        me = str(_rank())
        self.faults = [f for f in _faults() if f[1] in (me, "*")]
        if self.fc.weight.is_meta:  # the launcher's check before spawning (preflight): not a rank, no fault
            self.faults = []
            return
        _append(f"rank{me}", str(os.getpid()))
        if any(kind == "init" for kind, *_ in self.faults):
            raise RuntimeError("init boom")
        for kind, _, iteration, arg in self.faults:
            if kind == "slowwrite":
                self._slow_down_torch_save(iteration, 60.0 if arg is None else arg)
            if kind == "nospace":
                self._fill_the_disk(iteration)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.fc(x.flatten(1))
        self.calls += 1
        if self.calls <= 2:
            _append(f"forward{_rank()}", f"{os.getpid()} {self.calls} {time.time()}")
        if self.calls == 2:
            self._record_children()
        poison = False
        for kind, _, iteration, arg in self.faults:
            if kind == "slow" and self.calls >= iteration:
                time.sleep(0.2 if arg is None else arg)
            if self.calls != iteration or kind in ("slowwrite", "nospace", "slowsave"):
                continue
            kind = _fire(kind)
            if kind in ("raise", "kill", "losegpu", "deverror", "devassert"):
                _append(f"fault{_rank()}", f"{kind} {time.time()}")
            if kind == "raise":
                raise RuntimeError("boom")
            if kind == "deverror":
                raise RuntimeError("CUDA error: unspecified launch failure")
            if kind == "sleep":
                time.sleep(3600)
            if kind == "pause":
                time.sleep(5.0 if arg is None else arg)
            if kind == "hold":
                _hold(120.0 if arg is None else arg)
            if kind == "losegpu":
                _lose_my_gpu()
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "devassert":
                x = x + torch.zeros(1, device=x.device)[torch.tensor([x.shape[0] + 7], device=x.device)].sum()
                torch.cuda.synchronize() if x.is_cuda else None
            if kind == "nan":
                poison = True
        logits = self.fc(x.flatten(1))
        return logits * float("nan") if poison else logits

    def state_dict(self, *args, **kwargs):  # nn.Module's signature
        for kind, _, iteration, arg in self.faults:
            if kind == "slowsave" and self.calls >= iteration:
                _write(f"saving{_rank()}", "")  # the test may signal the job now
                time.sleep(3.0 if arg is None else arg)
        return super().state_dict(*args, **kwargs)

    def _slow_down_torch_save(self, iteration: int, seconds: float) -> None:
        save = torch.save  # ignite's DiskSaver looks up torch.save at every call

        def slow_save(obj, f, *args, **kwargs):  # torch.save's signature
            if self.calls < iteration or isinstance(f, (str, os.PathLike)):
                return save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            _write(f"halfwritten{_rank()}", "")  # the test may kill this process now
            time.sleep(seconds)
            f.write(data[len(data) // 2 :])
            return None

        torch.save = slow_save

    def _fill_the_disk(self, iteration: int) -> None:
        save = torch.save

        def no_space(obj, f, *args, **kwargs):  # torch.save's signature
            if self.calls < iteration or isinstance(f, (str, os.PathLike)):
                return save(obj, f, *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")

        torch.save = no_space

    @staticmethod
    def _record_children() -> None:
        try:
            import psutil
        except ImportError:
            return
        children = psutil.Process().children(recursive=True)
        _write(f"children{_rank()}", "\n".join(str(c.pid) for c in children))


def make(num_classes: int) -> nn.Module:
    """For 32x32 images (the default data.image_size)."""
    return FaultyLinear(num_classes, 32)


def make8(num_classes: int) -> nn.Module:
    """For data.image_size=8."""
    return FaultyLinear(num_classes, 8)
