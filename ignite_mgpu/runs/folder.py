"""What a run folder holds, by name: the one place those names are written. Torch-free, a leaf."""

from __future__ import annotations

import re
from pathlib import Path

RUNS = Path("runs")  # where runs without an output_dir go, each into a folder of its own
DEFAULT_RUN = RUNS / "default"  # training() called directly, without output_dir
# 2026-11-30_08-12-03[-2]: when it started.
RUN_NAME = re.compile(r"(\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d)(?:-(\d+))?")
CONFIG = "config.yaml"  # the fully resolved config, written by rank 0
METRICS = "metrics.jsonl"  # one JSON line per epoch
# Where the wall time went, for the run: its totals and the progress a restart resumes.
GOODPUT = "goodput.json"
LOCK = ".lock"  # held by the job writing there (lock.output_lock)
TENSORBOARD = "tb"  # the tensorboard tracker's event files
TRACKING_CSV = "tracking.csv"  # the csv tracker: one row per number logged
TRACKER_RUNS = "trackers.json"  # the MLflow and W&B runs of this folder, continued by a resumed run
MLFLOW_DB = "mlflow.db"  # the mlflow tracker's default store (sqlite:///<run folder>/mlflow.db)
MLFLOW_ARTIFACTS = "mlartifacts"  # its artifacts (config.yaml), with that default store
# Where the wandb tracker writes its run files (unless WANDB_DIR or logger_args.wandb.dir)
WANDB = "wandb"
# train.micro_batch=auto: the size it found, read back by a restart or a resume.
MICRO_BATCH = "micro_batch.json"
# Where every rank was when the job hung (hang_2026-12-03_11-30-41.txt), written by the supervisor.
HANG_REPORT = "hang_{}.txt"
REPORT_IMAGE = "report.png"  # ignite-mgpu report's figure of one run
# The best model: best_model_<epoch>_val_<metric>=<score>.pt (or .safetensors: checkpoint.best_format); a loss used
# to be written negated (val_loss=-2.4889).
BEST_NAME = re.compile(r"^best_model_(\d+)_val_([A-Za-z_]\w*)=(-?[\d.]+)\.(?:pt|safetensors)$")


def run_dir(output_dir: str | None) -> Path:
    """Where a run writes: ``output_dir``, or ``DEFAULT_RUN`` without one. ``fit`` and the CLI give a run without
    ``output_dir`` a new folder under runs/ before it starts; ``training`` called directly (``launch(training, cfg)``)
    writes to runs/default."""
    return Path(output_dir) if output_dir is not None else DEFAULT_RUN


def earlier_runs() -> list[Path]:
    """The dated folders under ``RUNS`` (new runs without an output_dir), oldest first by the time in their names."""
    found = sorted((m[1], int(m[2] or 1), p) for p in RUNS.glob("*") if (m := RUN_NAME.fullmatch(p.name)))
    return [p for *_, p in found]
