"""What each tracker needs: the packages to import (and the extra that installs them), the database drivers of an
MLflow tracking URI, the keys of ``train.logger_args`` each built-in tracker takes; ``check_trackers``, the pre-flight
check of them, without importing any tracker (torch-free)."""

from __future__ import annotations

import os

from ignite_mgpu.config.schema import TrainConfig, trackers_of
from ignite_mgpu.errors import ConfigError

# What each tracker needs installed: (modules, the extra that installs them, the packages named in the message).
TRACKER_PACKAGES = {
    "tensorboard": (("tensorboard",), "tensorboard", "tensorboard"),
    "mlflow": (("mlflow",), "mlflow", "mlflow-skinny (or mlflow)"),
    "wandb": (("wandb",), "wandb", "wandb"),
}
# Tracking URIs of a database: SQLAlchemy and Alembic.
MLFLOW_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
TRACKER_ARGS = {"mlflow": ("tracking_uri", "experiment", "run_name", "tags"), "tensorboard": (), "csv": ()}


def check_trackers(t: TrainConfig) -> None:
    """Every tracker of ``train.loggers`` (and ``train.tensorboard``) has its packages, and its
    ``train.logger_args`` entry only keys it takes; without importing any of them, except wandb to read
    ``wandb.init``'s keywords when ``logger_args.wandb`` names some."""
    import importlib.util

    for name in trackers_of(t):
        modules, extra, packages = TRACKER_PACKAGES.get(name, ((), "", ""))
        args = t.logger_args.get(name, {})
        uri = args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite"
        if name == "mlflow" and uri.split(":")[0].split("+")[0] in MLFLOW_DATABASES:
            modules, packages = (*modules, "sqlalchemy", "alembic"), f"{packages}, sqlalchemy and alembic"
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            alias = name == "tensorboard" and name not in t.loggers
            key, drop = ("train.tensorboard=true", "set it to false") if alias else ("train.loggers", "drop it")
            raise ConfigError(
                f"{key} asks for the {name} tracker, which needs {', '.join(missing)}, not installed here: "
                f"pip install 'ignite-mgpu[{extra}]' (that is, {packages}), or {drop}."
            )
    for name, args in t.logger_args.items():
        allowed = TRACKER_ARGS.get(name)
        # wandb.init's keywords.
        if allowed is None and args and importlib.util.find_spec("wandb") is not None:
            import inspect

            import wandb

            allowed = tuple(inspect.signature(wandb.init).parameters)
        unknown = [key for key in args if allowed is not None and key not in allowed]
        if unknown:
            raise ConfigError(
                f"train.logger_args.{name}.{unknown[0]} is not an argument of the {name} tracker; it takes "
                f"{', '.join(allowed or ()) or 'none'}. Fix the key, or drop it."
            )
