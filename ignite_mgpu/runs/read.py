"""Reading runs back for ``ignite-mgpu report``: the complete lines of ``metrics.jsonl``, the strategy and process
count from ``config.yaml``. Torch-free: it reads JSON and YAML only (``table`` prints them, ``figure`` draws)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.runs.folder import BEST_NAME, CONFIG, METRICS
from ignite_mgpu.runs.goodput_parts import read_totals
from ignite_mgpu.runs.metric_names import ranked
from ignite_mgpu.text import plural


@dataclass
class Run:
    """One run folder as read: ``epochs`` holds one metrics dict per epoch, in epoch order."""

    path: Path
    epochs: list[dict[str, Any]]
    dist: dict[str, Any]  # the dist section of config.yaml ({} without a readable one)
    incomplete_lines: int = 0  # lines of metrics.jsonl that are not a complete JSON object
    name: str = ""  # the folder's name, or its path where two runs share a name (set by read_runs)
    config_note: str = ""  # why dist is empty: "no config.yaml" or "config.yaml unreadable"
    # The run's totals (runs/goodput_parts.py); {}: none recorded.
    goodput: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str) -> list[float]:
        """``key`` of every epoch as floats; NaN where it is missing, null or not a number (a gap in a plot)."""
        return [as_number(row.get(key)) for row in self.epochs]

    def has(self, key: str) -> bool:
        """Whether any epoch has a finite ``key`` (e.g. val_accuracy: not every task has one)."""
        return any(math.isfinite(v) for v in self.series(key))

    @property
    def last(self) -> dict[str, Any]:
        return self.epochs[-1]

    @property
    def memory(self) -> list[float]:
        """Peak memory (MB) of each GPU or process in the last epoch."""
        return [as_number(mb) for mb in self.last.get("peak_memory_mb") or []]

    @property
    def memory_per(self) -> str | None:
        """What each memory entry measures: "gpu" or "process" (None: an older metrics.jsonl that does not say)."""
        per = self.last.get("peak_memory_per")
        return per if per in ("gpu", "process") else ("gpu" if self.strategy == "dp" else None)

    @property
    def strategy(self) -> str | None:
        return self.dist.get("strategy")

    @property
    def processes(self) -> int:
        """Processes of the job: 1 with dp (one process drives every GPU), else ``nproc x nnodes`` from config.yaml
        or, where nproc is null (the default: one per GPU, or 1 on a CPU), the ranks that reported memory."""
        if self.strategy == "dp":
            return 1
        nproc = _positive_int(self.dist.get("nproc"))
        return nproc * self.nnodes if nproc else len(self.memory)

    @property
    def nnodes(self) -> int:
        return _positive_int(self.dist.get("nnodes")) or 1

    @property
    def label(self) -> str:
        """The legend's name: folder, strategy and processes, e.g. "ddp (ddp, 2 processes, CPU)"."""
        if not self.strategy:
            return f"{self.name} ({self.config_note or 'no dist.strategy in config.yaml'})"
        if self.strategy == "dp":
            return f"{self.name} (dp, 1 process, {plural(len(self.memory), 'GPU')})"
        where = f" on {self.nnodes} nodes" if self.nnodes > 1 else ""
        cpu = ", CPU" if self.memory_per == "process" else ""
        return f"{self.name} ({self.strategy}, {plural(self.processes, 'process')}{where}{cpu})"


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def as_number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The epochs of a metrics.jsonl and how many lines were not a complete JSON object with an epoch (a run killed
    while writing, or still writing). An epoch written twice (a resumed run repeats the epochs after its
    checkpoint) keeps its later line."""
    by_epoch: dict[int, dict[str, Any]] = {}
    incomplete = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("epoch"), int):
            by_epoch[row["epoch"]] = row
        else:
            incomplete += 1
    return [by_epoch[e] for e in sorted(by_epoch)], incomplete


def _read_section(folder: Path, name: str) -> tuple[dict[str, Any], str]:
    """A section of config.yaml (dist, checkpoint), read leniently (a config of another version still labels its
    run); {} and why where there is none."""
    import yaml  # PyYAML comes with OmegaConf

    path = folder / CONFIG
    if not path.is_file():
        return {}, "no config.yaml"
    try:
        config = yaml.safe_load(path.read_text(errors="replace"))
    except (OSError, yaml.YAMLError):
        return {}, "config.yaml unreadable"
    section = config.get(name) if isinstance(config, dict) else None
    return (section, "") if isinstance(section, dict) else ({}, f"config.yaml without {name}")


def last_epoch(folder: str | Path) -> dict[str, Any]:
    """The last complete epoch of a run's metrics.jsonl; {} where there is none (yet)."""
    try:
        epochs, _ = read_metrics(Path(folder) / METRICS)
    except OSError:
        return {}
    return epochs[-1] if epochs else {}


def best_model(folder: str | Path) -> Path | None:
    """The run's best model file (best_model_<epoch>_val_<metric>=<score>.pt or .safetensors: the highest accuracy,
    the lowest loss, whatever the sign an older name gave it; a metric of the user's as config.yaml's
    checkpoint.metric_mode says)."""
    scored = [(m[2], float(m[3]), p) for p in Path(folder).glob("best_model_*") if (m := BEST_NAME.match(p.name))]
    mode = str(_read_section(Path(folder), "checkpoint")[0].get("metric_mode", "auto")) if scored else "auto"
    found = [(ranked(metric, value, mode), p) for metric, value, p in scored]
    return max(found)[1] if found else None


def read_run(folder: str | Path) -> Run:
    """Read one run folder (an ``output_dir``).

    Raises:
        ConfigError: no such folder, or no readable metrics.jsonl with a complete line in it.
    """
    folder = Path(folder)
    metrics = folder / METRICS
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such folder. Give the run's output_dir, the folder with metrics.jsonl.")
    if not metrics.is_file():
        raise ConfigError(
            f"{folder} has no metrics.jsonl, and no folder in it has one. A run appends one line to it after each "
            "finished epoch (and its validation), so either the path is neither a run's output_dir nor a folder of "
            "runs (such as runs/), or the run has not finished its first epoch yet: check the path, or wait for the "
            "first epoch."
        )
    try:
        epochs, incomplete = read_metrics(metrics)
    except OSError as err:
        raise ConfigError(f"cannot read {metrics}: {err.strerror}. Check its permissions.") from err
    if not epochs:
        raise ConfigError(
            f"{metrics} has no complete line ({incomplete} incomplete line(s) ignored): the run has not finished "
            "its first epoch yet, or was stopped while writing it. Wait for the first epoch, or train again."
        )
    dist, note = _read_section(folder, "dist")
    name = folder.resolve().name or str(folder)
    return Run(folder, epochs, dist, incomplete, name, note, read_totals(folder, epochs))


def run_folders(folders: Sequence[str | Path]) -> list[Path]:
    """The run folders that ``folders`` name: each one itself, or, for a folder of runs (``runs/``: no
    metrics.jsonl of its own), the runs in it, each a folder with a metrics.jsonl, by name."""
    found: list[Path] = []
    for given in map(Path, folders):
        inner = []
        if given.is_dir() and not (given / METRICS).exists():
            inner = sorted(d for d in given.iterdir() if d.is_dir() and (d / METRICS).is_file())
        found.extend(inner or [given])
    return found


def read_runs(folders: Sequence[str | Path]) -> list[Run]:
    """Read every folder (a folder of runs: each run in it, ``run_folders``); a run is named by its folder's name,
    or by the path given where two names clash."""
    runs = [read_run(f) for f in run_folders(folders)]
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = str(run.path)
    return runs


def memory_names(run: Run) -> list[str]:
    """A name for each memory entry: "cuda:k" for the GPUs of one dp process, else "rank k"."""
    return [f"cuda:{k}" if run.strategy == "dp" else f"rank {k}" for k in range(len(run.memory))]


def memory_kind(run: Run) -> str:
    return {"gpu": "GPU, peak allocated", "process": "process, peak RSS"}.get(run.memory_per or "", "GPU or process")
