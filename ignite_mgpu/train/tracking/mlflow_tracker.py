"""The mlflow tracker: ignite's MLflowLogger and OutputHandler over an ``MlflowClient`` and one run, at
``train.logger_args.mlflow.tracking_uri`` (or MLFLOW_TRACKING_URI; default: a SQLite store in the run folder);
a resumed run continues the same MLflow run."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events
from ignite.handlers import MLflowLogger, mlflow_logger

from ignite_mgpu.runs import folder
from ignite_mgpu.train.tracking.backends import DEFAULT_PROJECT, Backend

# Bounds on MLflow's HTTP requests (unless set): a server that does not answer stops the tracker after about a
# minute, once, instead of MLflow's own 7 retries of up to 120 s each. MLflow reads them from the environment at
# each request; they are there only during the tracker's own requests (``_BoundedClient``).
MLFLOW_HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter's value
MAX_QUEUED = 10_000  # requests waiting for the server; past that the tracker stops
CLOSE_TIMEOUT = 60.0  # seconds the requests still queued at the end of training may take


class _MLflowOutputHandler(mlflow_logger.OutputHandler):
    """ignite's MLflow OutputHandler, with the names the other trackers use ("val/accuracy", not "val accuracy")."""

    def __call__(self, engine: Engine, logger: MLflowLogger, event_name: str | Events) -> None:
        metrics = self._setup_output_metrics_state_attrs(engine, key_tuple=False)
        # MLflow refuses a whole batch for one bad name.
        valid = {k: v for k, v in metrics.items() if _valid_name(k)}
        logger.log_metrics(valid, step=self.global_step_transform(engine, event_name))


def _valid_name(name: str) -> bool:
    try:
        # What ignite's handler checks too.
        from mlflow.utils.validation import validate_param_and_metric_name
    except ImportError:  # not in every MLflow release: let the store judge
        return True
    return bool(validate_param_and_metric_name(name))


class _Sender:
    """A thread that sends one tracker's requests in order, so that a slow or dead server never holds the training
    (nor, through rank 0, the other ranks at their next collective). Its first error is raised at the next
    ``submit`` or at ``close``, in the training's thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue[tuple[Any, tuple] | None] = queue.Queue(maxsize=MAX_QUEUED)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            try:
                fn(*args)
            except Exception as err:  # reported in the training's thread, then nothing more is sent
                self.error = err
                return

    def submit(self, fn: Any, *args: Any) -> None:
        if self.error is not None:
            raise self.error
        try:
            self._queue.put_nowait((fn, args))
        except queue.Full:
            raise RuntimeError(f"the server takes too long: {MAX_QUEUED} requests are waiting") from None

    def close(self, timeout: float) -> None:
        """Send what is queued (at most ``timeout`` seconds), then stop; raises the first error, if any."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not take the last requests in {timeout:.0f} s")


class _MLflowClientLogger(MLflowLogger):
    """ignite's MLflowLogger writing through an ``MlflowClient`` into one run, from a ``_Sender`` thread. Not
    MLflow's fluent API, which ignite's uses: it would export MLFLOW_TRACKING_URI into this process's environment
    and keep an active run per thread (both seen by the user's own MLflow code in a notebook, and by the next run
    started there)."""

    # Not MLflowLogger's: it starts a fluent run.
    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.sender = _Sender("ignite-mgpu mlflow")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        self.sender.submit(self.client.log_batch, self.run_id, batch)

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        self.sender.submit(self.client.log_batch, self.run_id, [], [Param(k, v) for k, v in params.items()])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.sender.submit(self.client.log_batch, self.run_id, [], [], [RunTag(k, v) for k, v in tags.items()])

    def log_artifact(self, path: str) -> None:
        self.sender.submit(self.client.log_artifact, self.run_id, path)

    def close(self, status: str = "FINISHED") -> None:
        self.sender.close(CLOSE_TIMEOUT)


class _BoundedClient:
    """An MlflowClient whose calls run with ``MLFLOW_HTTP_LIMITS`` in the environment (each one the user did not
    set), removed again after each call: the process's environment stays as it was."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def bounded(*args: Any, **kwargs: Any) -> Any:
            added = [var for var in MLFLOW_HTTP_LIMITS if var not in os.environ]
            os.environ.update({var: MLFLOW_HTTP_LIMITS[var] for var in added})
            try:
                return method(*args, **kwargs)
            finally:
                for var in added:
                    os.environ.pop(var, None)

        return bounded


class MLflow(Backend):
    """ignite's MLflowLogger on a run of ``logger_args.mlflow.experiment``, at ``tracking_uri`` (or
    MLFLOW_TRACKING_URI; default: ``sqlite:///<run folder>/mlflow.db``, artifacts in the run folder)."""

    name, output_handler = "mlflow", _MLflowOutputHandler

    def __init__(
        self, args: dict[str, Any], out: Path, trainer: Engine, resumed: dict[str, str] | None, params: dict[str, str]
    ) -> None:
        import mlflow

        # Their INFO lines (creating the database) would fill rank 0's log.
        for noisy in ("mlflow", "alembic"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        given = args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        self.uri: str = given or f"sqlite:///{(out / folder.MLFLOW_DB).resolve()}"
        client = mlflow.MlflowClient(self.uri)
        self.client: Any = _BoundedClient(client) if self.uri.startswith(("http:", "https:")) else client
        remembered = resumed or {}
        run_id = remembered.get("run_id") if remembered.get("tracking_uri") == self.uri else None
        # Deleted, or another store: a new run.
        self.resumed = run_id is not None and self._exists(run_id)
        if run_id is not None and self.resumed:
            self.client.update_run(run_id, status="RUNNING")
        else:
            artifacts = (out / folder.MLFLOW_ARTIFACTS).resolve().as_uri() if given is None else None
            run_id = self._new_run(args, artifacts, out.name)
        self.run_id: str = run_id
        # Its thread waits as long as MLflow's own limits.
        self.logger = _MLflowClientLogger(client, self.run_id)

    def _new_run(self, args: dict[str, Any], artifacts: str | None, default_name: str) -> str:
        """A run in ``args["experiment"]`` (or MLFLOW_EXPERIMENT_NAME, or ignite-mgpu), created with its artifacts
        at ``artifacts`` if it is new (None: the store's default)."""
        name = args.get("experiment") or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name, artifacts)
        tags = {str(k): str(v) for k, v in (args.get("tags") or {}).items()}
        run = self.client.create_run(experiment_id, run_name=args.get("run_name") or default_name, tags=tags)
        return str(run.info.run_id)

    def _exists(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
        # mlflow's RESOURCE_DOES_NOT_EXIST, whatever its class in this mlflow version.
        except Exception:
            return False
        return True

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.logger.log_metrics(values, step=step)

    def record_run(self, params: dict[str, str], config_file: Path, facts: dict[str, Any]) -> None:
        logged = self.client.get_run(self.run_id).data.params if self.resumed else {}
        params = {k: v[:MAX_PARAM_LENGTH] for k, v in params.items()}
        changed = [f"{k}: {logged[k]} -> {v}" for k, v in params.items() if k in logged and logged[k] != v]
        # A parameter never changes.
        self.logger.log_params({k: v for k, v in params.items() if k not in logged})
        tags = {f"ignite_mgpu.{k}": str(v) for k, v in facts.items()}
        if changed:
            tags["ignite_mgpu.changed_on_resume"] = "; ".join(changed)[:MAX_PARAM_LENGTH]
        if facts.get("git_commit") not in (None, "unknown"):
            # What MLflow's UI shows as the version.
            tags["mlflow.source.git.commit"] = str(facts["git_commit"])
        self.logger.set_tags(tags)
        self.logger.log_artifact(str(config_file))

    def remembered(self) -> dict[str, str]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def close(self, status: str) -> None:
        try:
            self.logger.close()
        finally:
            self.client.set_terminated(self.run_id, status)

    def abandon(self) -> None:
        """After a failed request: the store failed, so nothing more is asked of it (not even to end the run)."""
