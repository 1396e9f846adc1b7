"""``ignite-mgpu scale``: the job's own step measured on 1, 2, ... up to the GPUs (or CPU processes) asked for, and
the table of samples/s, speed-up, scaling efficiency and where the lost time went, with the verdict in one line and
the published figure nearest to the run. Each size runs ``train/measuring.py`` in its own workers, in a temporary
folder of its own (removed; kept and named when a size fails): no checkpoint, no tracker, nothing written to a run
folder. The GPUs are claimed once, like any job's, for every size."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from ignite_mgpu import text
from ignite_mgpu.config.checks import validate
from ignite_mgpu.config.schema import Config
from ignite_mgpu.env import cluster
from ignite_mgpu.errors import CheckpointError, ConfigError, signal_exit_code
from ignite_mgpu.gpus.ranges import gpu_range
from ignite_mgpu.jobs import checked_plan, refused, said
from ignite_mgpu.preflight import check_datasets, check_job, check_model_options
from ignite_mgpu.processes import forkserver, launcher
from ignite_mgpu.processes.job import Job
from ignite_mgpu.processes.plan import LaunchPlan
from ignite_mgpu.runs import efficiency, published
from ignite_mgpu.runs.efficiency import Size

MEASURING = "ignite_mgpu.train.measuring:measuring"
ITERATIONS = 20  # measured at each size, after as many of warm-up
BATCHES = ("per-process", "global")
STOPPED = (signal_exit_code(signal.SIGINT), signal_exit_code(signal.SIGTERM))  # Ctrl-C, a scheduler's SIGTERM


@dataclasses.dataclass(frozen=True)
class Step:
    """One size to measure: its devices, its plan and the config its workers run."""

    devices: int
    plan: LaunchPlan
    cfg: Config


def sizes_up_to(n: int) -> list[int]:
    """The sizes measured up to ``n``: every one up to 4, then the powers of two and ``n`` (8 GPUs: 1, 2, 4, 8)."""
    if n <= 4:
        return list(range(1, n + 1))
    return sorted({*(2**k for k in range(n.bit_length()) if 2**k < n), n})


def scale(cfg: Config, iterations: int = ITERATIONS, batch: str = "per-process", as_json: bool = False) -> int:
    """Measure ``cfg``'s training step at each size up to the GPUs or processes that ``cfg.dist`` asks for, and print
    the table (``as_json``: one JSON object). ``batch``: "per-process" keeps each process's batch as it is at the
    largest size (the global batch grows with the processes, as published scaling figures measure); "global" keeps
    ``data.batch_size`` at every size (what this config's job does on fewer GPUs; one process must hold it all).

    A size that fails or is stopped (Ctrl-C, SIGTERM) ends the measure: the sizes measured before it are printed,
    then its exit code is returned.

    Returns:
        0; 2 with the reason when a check fails (before any process starts); a failed or stopped size's exit code.
    """
    try:
        validate(cfg)
        _check_request(cfg, iterations, batch)
        check_job(cfg)
        with checked_plan(_measured(cfg, iterations)) as (plan, claims):
            steps = _steps(_measured(cfg, iterations), plan, batch)
            found, code = _measure(steps, claims, iterations)
    except (ConfigError, CheckpointError) as err:
        return refused(err)
    if found:
        print(_report(found, plan, cfg, batch, iterations, as_json))
    return code


def _check_request(cfg: Config, iterations: int, batch: str) -> None:
    if iterations < 2:
        raise ConfigError(f"--iters {iterations}: measure at least 2 iterations at each size (the default is 20).")
    if batch not in BATCHES:
        raise ConfigError(f"--batch {batch}: use per-process or global.")
    if cluster.started_externally() or cfg.dist.nnodes > 1:
        raise ConfigError(
            "ignite-mgpu scale starts its own processes at each size on this machine: run it outside torchrun or "
            "srun, on one node (--nnodes 1)."
        )
    if gpu_range(cfg.dist.gpus) is not None:
        raise ConfigError(
            f"--gpus {cfg.dist.gpus} is a range that changes while a job runs; scale measures fixed sizes: give the "
            "most GPUs to measure up to, as --gpus auto:N or physical ids (--gpus 0,1,2,3)."
        )


def _measured(cfg: Config, iterations: int) -> Config:
    """``cfg`` as every size runs it: two epochs of ``iterations`` (measuring.EPOCHS), no tracker, no progress bar,
    no resume, no restart; the folder is set per size."""
    train = dataclasses.replace(
        cfg.train, epochs=2, epoch_length=iterations, loggers=[], tensorboard=False, progress_bar=False
    )
    dist = dataclasses.replace(cfg.dist, max_restarts=0)
    return dataclasses.replace(cfg, train=train, dist=dist, resume=None, output_dir=None)


def _steps(cfg: Config, plan: LaunchPlan, batch: str) -> list[Step]:
    """Every size's plan and config, each checked as train checks its job (its model options, its data over its
    processes) before any size starts."""
    chosen = plan.gpus or []
    if plan.strategy == "dp" and not chosen:
        raise ConfigError("scale --strategy dp measures 1, 2, ... GPUs of one process: select them with --gpus.")
    largest = len(chosen) or plan.nproc
    per_device = max(1, cfg.data.batch_size // largest)
    steps: list[Step] = []
    for devices in sizes_up_to(largest):
        names = {i: plan.gpu_names.get(i, str(i)) for i in chosen[:devices]}
        at = plan.on_gpus(names) if chosen else plan.with_processes(devices)
        global_batch = per_device * devices if batch == "per-process" else cfg.data.batch_size
        sized = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=global_batch))
        check_model_options(sized, at)
        check_datasets(sized, at.world_size)
        steps.append(Step(devices, dataclasses.replace(at, messages=() if steps else at.messages), sized))
    return steps


def _measure(steps: list[Step], claims: Any, iterations: int) -> tuple[list[Size], int]:
    """Run every size in turn, up to the first that fails (its folder kept and named) or is stopped by a signal; the
    sizes measured and the exit code."""
    folder = Path(tempfile.mkdtemp(prefix="ignite-mgpu-scale-"))
    found: list[Size] = []
    with forkserver.kept_between_jobs():  # one server for every size: torch imported once
        for step in steps:
            out = folder / f"size-{step.devices}"
            job = Job(MEASURING, (dataclasses.replace(step.cfg, output_dir=str(out)), iterations))
            if launcher.in_workers(step.plan):
                forkserver.start(forkserver.preload_for(job), step.plan.preempt_signal)
            what = "GPU" if step.plan.device == "cuda" else "process"
            print(
                f"ignite-mgpu scale: {text.plural(step.devices, what)}, global batch {step.cfg.data.batch_size}: "
                f"{iterations} iterations of warm-up, then {iterations} measured",
                file=sys.stderr,
                flush=True,
            )
            ended = launcher.run_job(step.plan, job, claims, run_dir=str(out))
            if ended.outcome.code or not isinstance(ended.value, dict):
                return found, _stopped_at(step, ended.outcome.code or 1, folder)
            sharded = step.cfg.dist.strategy == "fsdp" and step.plan.world_size > 1
            found.append(Size.from_line(step.devices, step.cfg.data.batch_size, ended.value, sharded))
    shutil.rmtree(folder, ignore_errors=True)
    return found, 0


def _stopped_at(step: Step, code: int, folder: Path) -> int:
    """Say where the measure stopped: a failed size's files are kept for a look; a stop by Ctrl-C or SIGTERM leaves
    nothing."""
    if code in STOPPED:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"ignite-mgpu scale: stopped at {step.devices}.", file=sys.stderr)
    else:
        print(said(f"ignite-mgpu scale: stopped at {step.devices}; its files are in {folder}"), file=sys.stderr)
    return code


def _report(found: list[Size], plan: LaunchPlan, cfg: Config, batch: str, iterations: int, as_json: bool) -> str:
    """The table, the verdict of the largest size and the published figure nearest to it (GPUs only)."""
    device, base, largest = plan.device, found[0], found[-1]
    verdict = efficiency.verdict(base, largest, device) if len(found) > 1 else "one size: nothing to compare"
    figure = None
    if device == "cuda" and len(found) > 1:
        mixed = cfg.train.precision in ("fp16", "bf16")
        figure = published.nearest(_nvlinked(plan.gpus or []), mixed, largest.devices, largest.per_device)
    if as_json:
        fields = {"device": device, "batch": batch, "iterations": iterations, "verdict": verdict}
        return json.dumps(fields | {"published": figure, "sizes": efficiency.as_json(found)})
    lines = [efficiency.table(found, device), "", f"verdict: {verdict}"]
    if figure:
        lines.append(f"published: {figure}")
    return "\n".join(lines)


def _nvlinked(gpus: list[int]) -> bool:
    """Whether every pair of ``gpus`` is linked by NVLink, as the machine's snapshot says."""
    from ignite_mgpu.gpus.inventory import query_gpus

    if len(gpus) < 2:  # one GPU, or GPUs as the environment has them: which ones is not known here
        return False
    links = {g.index: dict(g.links) for g in query_gpus() if g.index in gpus}
    return all(links.get(a, {}).get(b, "").startswith("NV") for a in gpus for b in gpus if a < b)
