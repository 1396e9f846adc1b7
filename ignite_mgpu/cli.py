"""The ``ignite-mgpu`` command: argv -> Config -> launch. No training logic here; torch is imported lazily so
``--help`` answers fast. Exit codes: 0 ok, 1 a rank failed, 2 usage/config error, 3 diverged, 130/143 signals."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import click

# CLI flag -> config key; flags are applied after --config and the positional key=value overrides.
FLAGS = {
    "nproc": "dist.nproc",
    "backend": "dist.backend",
    "gpus": "dist.gpus",
    "strategy": "dist.strategy",
    "nnodes": "dist.nnodes",
    "node_rank": "dist.node_rank",
    "master_addr": "dist.master_addr",
    "master_port": "dist.master_port",
    "timeout": "dist.timeout",
    "output_dir": "output_dir",
    "resume": "resume",
    "seed": "seed",
}


def _fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"ignite-mgpu: error: {message}", err=True)
    sys.exit(code)


def dist_options(fn: Any) -> Any:
    """The process/GPU flags shared by ``train`` and ``evaluate``."""
    options = [
        click.option("--nproc", type=int, help="Processes on this node [default: selected GPUs, or 1 on CPU]."),
        click.option(
            "--backend", type=click.Choice(["auto", "nccl", "gloo"]), help="auto = nccl with CUDA, else gloo."
        ),
        click.option("--gpus", help="Physical GPU ids as nvidia-smi shows them (2,3), all, none, auto or auto:N."),
        click.option(
            "--strategy",
            type=click.Choice(["ddp", "dp"]),
            help="ddp: a process per GPU (default); dp: one process with nn.DataParallel.",
        ),
        click.option("--nnodes", type=int, help="Machines in the job (multi-node: also --node-rank, --master-*)."),
        click.option("--node-rank", type=int, help="This machine's index, 0..nnodes-1."),
        click.option("--master-addr", help="Address of node 0 [default: 127.0.0.1]."),
        click.option(
            "--master-port", type=int, help="TCP port on node 0 (one node without it: private file rendezvous)."
        ),
        click.option("--timeout", type=float, help="Seconds a collective may wait after the first iteration [300]."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load(args: tuple[str, ...], config_path: str | None, flags: dict[str, Any]) -> Any:
    from ignite_mgpu.config import load_config

    files = [a for a in args if "=" not in a and a.endswith((".yaml", ".yml"))]
    overrides = [a for a in args if a not in files]
    if files and config_path or len(files) > 1:
        _fail("give one config file, either as --config FILE or as the first argument.")
    extra = [f"{FLAGS[k]}={'null' if v is None else v}" for k, v in flags.items() if v is not None]
    return load_config(config_path or (files[0] if files else None), overrides + extra)


@contextlib.contextmanager
def _errors_to_exit() -> Iterator[None]:
    from ignite_mgpu.checkpoint import CheckpointError
    from ignite_mgpu.config import ConfigError

    try:
        yield
    except (ConfigError, CheckpointError) as err:
        _fail(str(err))


def _lock_owner(output_dir: Path) -> str | None:
    """Who holds ``output_dir/.lock`` ("pid N on host H"), or None when no running job holds it.

    The lock is an ``fcntl.flock`` on the file, so the kernel (and the NFS lock manager) drops it when its job
    dies, however it dies: a lock file left behind by a killed job locks nothing.
    """
    import fcntl

    try:
        fd = os.open(output_dir / ".lock", os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another job"
    except OSError:
        return None  # no flock on this file system; _output_lock warns about it
    finally:
        os.close(fd)  # also releases the probe's shared lock
    return None


def _locked_message(output_dir: Path, owner: str) -> str:
    return (
        f"output_dir {output_dir} is locked by {owner}, another job writing there; wait for it or choose "
        "another --output-dir."
    )


def _take_lock(lock: Path, output_dir: Path) -> int | None:
    """An fd holding an exclusive ``flock`` on ``lock``; exits (code 2) when another job holds it; None (with a
    warning) on a file system without ``flock``."""
    import fcntl

    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            _fail(f"cannot open {lock} ({err.strerror}); choose another --output-dir.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another job"
            os.close(fd)
            _fail(_locked_message(output_dir, owner))
        except OSError as err:  # e.g. Lustre mounted noflock, NFS without a lock manager
            os.close(fd)
            click.echo(
                f"ignite-mgpu: warning: cannot lock {lock} ({err.strerror}): a second job started on the same "
                "output_dir would not be refused.",
                err=True,
            )
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # locked a file that a finishing job has just removed: lock the one at the path now


@contextlib.contextmanager
def _output_lock(output_dir: Path) -> Iterator[None]:
    """One job per output folder: a second one fails fast instead of mixing checkpoints."""
    import socket

    output_dir.mkdir(parents=True, exist_ok=True)
    lock = output_dir / ".lock"
    fd = _take_lock(lock, output_dir)
    if fd is None:
        yield
        return
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode())
        yield
    finally:
        lock.unlink(missing_ok=True)  # before the unlock: a waiting job then re-checks and locks a new file
        os.close(fd)


def check_output_dir(cfg: Any) -> None:
    """Never mix two runs' checkpoints: an output_dir with checkpoints needs --resume (or a new folder)."""
    from ignite_mgpu import checkpoint as ckpt
    from ignite_mgpu.config import ConfigError

    out = Path(cfg.output_dir)
    owner = _lock_owner(out)
    if owner is not None:  # before anything else: the checkpoints there are the running job's
        raise ConfigError(_locked_message(out, owner))
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"output_dir {out.resolve()} is not writable; choose another --output-dir.")
    check_no_foreign_checkpoints(cfg)
    if cfg.resume == "auto" and ckpt.find_resumable(out) is None:
        raise ConfigError(
            f"--resume auto: no complete checkpoint in {out.resolve()} to resume from. "
            "Drop --resume to start a new run there."
        )
    if cfg.resume not in (None, "auto"):
        path = Path(cfg.resume)
        if not path.is_file():
            raise ConfigError(f"--resume {path}: no such file. Pass a checkpoint_<iteration>.pt path, or auto.")
        if not ckpt.is_complete(path):
            _fail(
                f"--resume {path.resolve()}: the file is corrupt or truncated (not a complete checkpoint "
                "archive). Use an earlier checkpoint, or --resume auto to pick the newest complete one.",
                code=1,
            )


def check_no_foreign_checkpoints(cfg: Any) -> None:
    """A new run (no --resume) needs an output_dir without checkpoints; checked again once the lock is held."""
    from ignite_mgpu import checkpoint as ckpt
    from ignite_mgpu.config import ConfigError

    out = Path(cfg.output_dir)
    existing = ckpt.list_checkpoints(out) if out.is_dir() else []
    if cfg.resume is None and existing:
        raise ConfigError(
            f"output_dir {out.resolve()} already holds checkpoints of an earlier run ({existing[0].name}, ...). "
            "Continue it with --resume auto, or choose a new --output-dir; nothing was deleted."
        )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ignite-mgpu")
def main() -> None:
    """Multi-GPU (and multi-process CPU) training with PyTorch-Ignite, without the classic traps.

    \b
      ignite-mgpu train --nproc 2                      # default job: small CNN on synthetic data
      ignite-mgpu train configs/cifar10_resnet18.yaml --gpus 2,3 optim.lr=0.1
      ignite-mgpu devices                              # which GPUs exist and which are busy

    Exit codes: 0 success, 1 a rank failed, 2 usage or config error, 3 training diverged (non-finite loss),
    130 SIGINT, 143 SIGTERM.
    """


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file over the defaults.")
@dist_options
@click.option("--output-dir", help="Folder for config.yaml, metrics.jsonl and checkpoints.")
@click.option("--resume", help="Checkpoint path, or auto (newest complete checkpoint in output_dir).")
@click.option("--seed", type=int, help="Seed for data order, initialisation and the synthetic data.")
def train(args: tuple[str, ...], config_path: str | None, **flags: Any) -> None:
    """Train: defaults < --config FILE.yaml < key=value overrides < flags.

    \b
    ARGS are dotted overrides such as optim.lr=0.05 train.epochs=3 data.batch_size=256
    (or a YAML file as the first argument). data.batch_size is the GLOBAL batch, split over all processes.
    See configs/default.yaml for every key.
    """
    bad_flags = [a for a in args if a.startswith("-")]
    if bad_flags:
        _fail(f"no such option: {bad_flags[0]} (see ignite-mgpu train --help).")
    with _errors_to_exit():
        cfg = _load(args, config_path, flags)
        from ignite_mgpu.config import ConfigError
        from ignite_mgpu.data import GENERATED, build_datasets, check_sizes
        from ignite_mgpu.launcher import make_plan, run_named, run_plan
        from ignite_mgpu.models import check_model_name

        check_model_name(cfg.model.name)
        if cfg.train.tensorboard:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "train.tensorboard=true needs the tensorboard package: "
                    "pip install tensorboard (or pip install -e '.[tensorboard]')."
                ) from None
        # Only the job's first process checks and locks output_dir: other nodes may share it (NFS), and under
        # torchrun/SLURM every process runs this command.
        leader = cfg.dist.node_rank == 0 and int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0
        if leader:
            check_output_dir(cfg)
        plan = make_plan(cfg.dist)
        if cfg.data.name in GENERATED:  # sizes known from the config: only the workers generate the data
            sizes = range(cfg.data.train_size), range(cfg.data.val_size)
            check_sizes(*sizes, cfg.data.batch_size, plan.world_size)  # type: ignore[arg-type]  # sized like datasets
        else:
            train_ds, val_ds = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
            check_sizes(train_ds, val_ds, cfg.data.batch_size, plan.world_size)
            del train_ds, val_ds
    lock = _output_lock(Path(cfg.output_dir)) if leader else contextlib.nullcontext()
    with lock:
        if leader:  # again under the lock: a job may have run there since the first check
            with _errors_to_exit():
                check_no_foreign_checkpoints(cfg)
        code = run_plan(plan, run_named, "ignite_mgpu.train:training", cfg)
    sys.exit(code)


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option(
    "--checkpoint",
    "checkpoint_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="A best_model_*.pt, checkpoint_*.pt or any (even module.-prefixed) state_dict file.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML of the run (model, data).")
@dist_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def evaluate(args: tuple[str, ...], checkpoint_path: str, config_path: str | None, as_json: bool, **flags: Any) -> None:
    """Evaluate saved weights on the validation split and print accuracy and loss."""
    with _errors_to_exit():
        cfg = _load(args, config_path, flags)
        from ignite_mgpu import checkpoint as ckpt
        from ignite_mgpu.data import build_datasets
        from ignite_mgpu.launcher import make_plan, run_plan
        from ignite_mgpu.models import create_model

        _, val_ds = build_datasets(cfg.data, cfg.model.num_classes, cfg.seed)
        model = create_model(cfg.model, val_ds[0][0].unsqueeze(0))
        ckpt.load_checkpoint(checkpoint_path, {"model": model}, map_location="cpu")
        plan = make_plan(cfg.dist)
    from ignite_mgpu.train import evaluation

    sys.exit(run_plan(plan, evaluation, cfg, checkpoint_path, as_json))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def devices(as_json: bool) -> None:
    """List every GPU: physical id, PCI bus, memory, utilisation, processes, and its CUDA index here."""
    from ignite_mgpu import gpus

    click.echo(gpus.format_devices(gpus.query_gpus(), os.environ, as_json=as_json))


@main.group()
def checkpoint() -> None:
    """Inspect or convert checkpoint files (always loaded with weights_only=True)."""


@checkpoint.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect(path: str, as_json: bool) -> None:
    """Show what a checkpoint holds: entries, step, parameters, dtypes, wrapper prefixes."""
    import json

    with _errors_to_exit():
        from ignite_mgpu import checkpoint as ckpt

        info = ckpt.describe(path)
    click.echo(json.dumps(info, indent=2) if as_json else "\n".join(f"{k}: {v}" for k, v in info.items()))


@checkpoint.command()
@click.argument("src", type=click.Path(dir_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
def convert(src: str, dst: str) -> None:
    """Write a clean model state_dict (no module./_orig_mod. prefixes) from SRC into DST."""
    with _errors_to_exit():
        from ignite_mgpu import checkpoint as ckpt

        found = ckpt.convert(src, dst)
    click.echo(f"wrote {dst}" + (f" (stripped {' and '.join(found)})" if found else " (no prefix found)"))
