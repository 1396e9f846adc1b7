"""One class per experiment tracker (tensorboard, wandb, csv; mlflow's is ``mlflow_tracker.py``), each around
pytorch-ignite's logger for it: how it starts (where it writes, the run it continues), its ``OutputHandler``, how
it writes the epoch log's numbers and the run's config and facts, and how it ends. The wiring common to all of
them is ``trackers.py``'s."""

from __future__ import annotations

import inspect
import os
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from ignite.engine import Engine
from ignite.handlers import (
    TensorboardLogger,
    WandBLogger,
    tensorboard_logger,
    wandb_logger,
)

from ignite_mgpu.runs import folder
from ignite_mgpu.train.tracking.csv_logger import CsvLogger
from ignite_mgpu.train.tracking.csv_logger import OutputHandler as CsvOutputHandler

DEFAULT_PROJECT = "ignite-mgpu"  # the MLflow experiment and the W&B project unless named


class Backend(ABC):
    """What every tracker offers the wiring: its ignite logger and ``output_handler`` class; ``epochs_as_steps``:
    the per-epoch numbers are at step = epoch (False: at the trainer's iteration, for W&B, whose steps only grow).

    Each is built from its ``train.logger_args`` entry, the run folder, the trainer (its state: where a resumed run
    starts), what this folder's interrupted run remembered of it (None: a new run) and the flattened config.
    """

    name = ""
    output_handler: type = tensorboard_logger.OutputHandler
    epochs_as_steps = True
    logger: Any = None

    @abstractmethod
    def scalars(self, values: dict[str, float], step: int) -> None:
        """The epoch log's numbers (``trackers.epoch_numbers``) at ``step``."""

    @abstractmethod
    def record_run(self, params: dict[str, str], config_file: Path, facts: dict[str, Any]) -> None:
        """The resolved config (flattened ``params``, and the file itself where the tracker keeps files) and the
        facts of this start (``run_facts.run_facts``)."""

    def remembered(self) -> dict[str, str]:
        """What a resumed run needs to continue this tracker's run (``runs.folder.TRACKER_RUNS``)."""
        return {}

    def close(self, status: str) -> None:
        """End the tracker's run; ``status``: FINISHED, FAILED or KILLED (stopped by a signal)."""
        self.logger.close()

    def abandon(self) -> None:
        """After this tracker failed: release what it holds here (files, processes) as it can."""
        self.close("FAILED")


class TensorBoard(Backend):
    """ignite's TensorboardLogger into ``<run folder>/tb``: the same event files as before train.loggers."""

    name = "tensorboard"

    def __init__(
        self, args: dict[str, Any], out: Path, trainer: Engine, resumed: dict[str, str] | None, params: dict[str, str]
    ) -> None:
        self.logger = TensorboardLogger(log_dir=str(out / folder.TENSORBOARD))

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.logger.writer.add_scalar(key, value, step)
        self.logger.writer.flush()

    def record_run(self, params: dict[str, str], config_file: Path, facts: dict[str, Any]) -> None:
        # A Markdown code block.
        indented = "".join(f"    {line}\n" for line in config_file.read_text().splitlines())
        self.logger.writer.add_text("config", indented)
        self.logger.writer.add_text("run", "\n\n".join(f"**{k}**: {v}" for k, v in facts.items()))


class _WandBLogger(WandBLogger):
    """ignite's WandBLogger; a resumed W&B run drops the steps it has already (W&B's steps only grow, and it would
    warn at each), so the iterations redone after a checkpoint keep their first values there."""

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        # The module ignite's logger started the run with (it keeps it in a private attribute)
        import wandb

        run = wandb.run
        if step is None or run is None or step >= run.step:
            wandb.log(data, step=step)


class WandB(Backend):
    """ignite's WandBLogger: ``logger_args.wandb`` are wandb.init's keywords (project, entity, mode, group, tags,
    settings, ...); WANDB_MODE=offline writes the run into ``<run folder>/wandb`` (or WANDB_DIR), for ``wandb
    sync``. Without credentials in online mode it does not start (no login prompt)."""

    name, output_handler, epochs_as_steps = "wandb", wandb_logger.OutputHandler, False

    def __init__(
        self, args: dict[str, Any], out: Path, trainer: Engine, resumed: dict[str, str] | None, params: dict[str, str]
    ) -> None:
        import wandb

        kwargs = dict(args)
        mode = kwargs.get("mode") or os.environ.get("WANDB_MODE") or "online"
        # Older wandb: no way to ask quietly.
        quiet_login = "prompt" in inspect.signature(wandb.login).parameters
        if mode not in ("offline", "dryrun", "disabled") and quiet_login:
            if not wandb.login(prompt=False, verify=False):
                raise RuntimeError(
                    "W&B has no API key (WANDB_API_KEY, or `wandb login`); run offline with WANDB_MODE=offline "
                    "(or train.logger_args.wandb.mode=offline) and upload later with `wandb sync`"
                )
        defaults = {"name": out.name, "id": (resumed or {}).get("id") or uuid.uuid4().hex[:8], "resume": "allow"}
        # Its wandb/ folder in the run folder.
        defaults |= {} if "WANDB_DIR" in os.environ else {"dir": str(out)}
        defaults |= {} if "WANDB_PROJECT" in os.environ else {"project": DEFAULT_PROJECT}
        kwargs = defaults | kwargs
        kwargs["config"] = {**params, **(kwargs.get("config") or {})}
        # W&B's copy of the console would repeat our log on its page and slow every write to stderr.
        kwargs["settings"] = wandb.Settings(**{"console": "off", "silent": True, **(kwargs.get("settings") or {})})
        self.id, self.own_service = kwargs["id"], "WANDB_SERVICE" not in os.environ
        self.logger = _WandBLogger(**kwargs)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.logger.log(values, step=step)

    def record_run(self, params: dict[str, str], config_file: Path, facts: dict[str, Any]) -> None:
        self.logger.config.update({f"ignite_mgpu.{k}": v for k, v in facts.items()}, allow_val_change=True)
        self.logger.save(str(config_file), base_path=str(config_file.parent), policy="now")

    def remembered(self) -> dict[str, str]:
        return {"id": self.id}

    def close(self, status: str) -> None:
        code = 0 if status == "FINISHED" else 1
        self.logger.finish(exit_code=code)
        # The wandb-core process this run started, and its WANDB_SERVICE variable, go too.
        if self.own_service:
            self.logger.teardown(exit_code=code)


class Csv(Backend):
    """CsvLogger into ``<run folder>/tracking.csv``; a resumed run first drops the rows after its checkpoint."""

    name, output_handler = "csv", CsvOutputHandler

    def __init__(
        self, args: dict[str, Any], out: Path, trainer: Engine, resumed: dict[str, str] | None, params: dict[str, str]
    ) -> None:
        keep = trainer.state.iteration if resumed is not None else None
        self.logger = CsvLogger(out / folder.TRACKING_CSV, trainer, keep_until=keep)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.logger.log("epoch", values)

    def record_run(self, params: dict[str, str], config_file: Path, facts: dict[str, Any]) -> None:
        self.logger.log("run", facts)  # the config is config.yaml, beside the file
