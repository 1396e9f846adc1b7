"""What each tracker needs: the packages to import (and the extra that installs them), the database drivers of an
MLflow tracking URI, the keys of ``train.logger_args`` each built-in tracker takes. Read by the pre-flight checks
without importing any tracker."""

# What each tracker needs installed: (modules, the extra that installs them, the packages named in the message).
TRACKER_PACKAGES = {
    "tensorboard": (("tensorboard",), "tensorboard", "tensorboard"),
    "mlflow": (("mlflow",), "mlflow", "mlflow-skinny (or mlflow)"),
    "wandb": (("wandb",), "wandb", "wandb"),
}
# Tracking URIs of a database: SQLAlchemy and Alembic.
MLFLOW_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
TRACKER_ARGS = {"mlflow": ("tracking_uri", "experiment", "run_name", "tags"), "tensorboard": (), "csv": ()}
