"""``main`` (the ``ignite-mgpu`` command group) and the commands that start jobs: argv into a Config, then the job
(``jobs.py``), then what it prints. The commands that read what is there are ``readers.py``'s."""

from __future__ import annotations

import signal
import sys
from typing import Any

import click

from ignite_mgpu import text
from ignite_mgpu.cli.options import (
    FLAGS,
    ScriptCommand,
    dist_options,
    errors_to_exit,
    fail,
    gpus_value,
    preempt_signal,
    rank_prefix_option,
    refuse_unknown_options,
    wait_and_share,
)
from ignite_mgpu.cli.readers import checkpoint, devices, report, stacks
from ignite_mgpu.config.schema import CPU_BINDINGS, STRATEGIES
from ignite_mgpu.env import clock
from ignite_mgpu.errors import exit_codes_text, signal_exit_code


def _load(args: tuple[str, ...], config_path: str | None, flags: dict[str, Any], check: bool = False) -> Any:
    """The config of a command's arguments; its values are checked by the job that runs it (``check``: here)."""
    from ignite_mgpu.config.loading import load_config

    files = [a for a in args if "=" not in a and a.endswith((".yaml", ".yml"))]
    overrides = [a for a in args if a not in files]
    if files and config_path or len(files) > 1:
        fail("give one config file, either as --config FILE or as the first argument.")
    extra = [f"{FLAGS[k]}={'null' if v is None else v}" for k, v in flags.items() if v is not None]
    return load_config(config_path or (files[0] if files else None), overrides + extra, check=check)


class _Commands(click.Group):
    """The command group; a Ctrl-C that reaches it (before a job's supervisor, which handles its own, or in a
    command without one) ends the command with 130 and one line, not click's "Aborted!" and 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\nignite-mgpu: stopped by Ctrl-C (SIGINT).", err=True)
            sys.exit(signal_exit_code(signal.SIGINT))


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=f"Exit codes: {exit_codes_text()}.",
)
@click.version_option(package_name="ignite-mgpu")
def main() -> None:
    """Multi-GPU (and multi-process CPU) training with PyTorch-Ignite, without the classic traps.

    \b
        ignite-mgpu train --nproc 2                      # default job: small CNN on synthetic data
        ignite-mgpu train my.yaml --gpus 2,3 optim.lr=0.1  # my.yaml: start from `ignite-mgpu config`
        ignite-mgpu devices                              # which GPUs exist and which are busy
        ignite-mgpu report runs/                         # every run compared: curves, memory, ./report.png
    """
    # Goodput's start-up counts from this interpreter's start: under `sh -c '... && ignite-mgpu train'` the shell
    # execs this command, and the process's start would count what the shell ran first.
    clock.use_interpreter_start()
    # Messages name this command's flags, not the config keys a Python caller sets; only while the command runs.
    said_on_the_command_line = text.ON_COMMAND_LINE.set(True)
    click.get_current_context().call_on_close(lambda: text.ON_COMMAND_LINE.reset(said_on_the_command_line))


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file over the defaults.")
@dist_options
@click.option("--output-dir", help="Folder for config.yaml, metrics.jsonl and checkpoints.")
@click.option(
    "--resume",
    help="Checkpoint path, or auto (newest complete checkpoint in output_dir; none yet: a new run), or a "
    ".safetensors file (weights only: a new run from them, fresh optimizer and schedule, epoch 0).",
)
@click.option(
    "--max-restarts",
    type=int,
    help="Restart the processes after a crash, a killed rank or a timeout, from the newest checkpoint [0].",
)
@click.option("--seed", type=int, help="Seed for data order, initialisation and the synthetic data.")
def train(args: tuple[str, ...], config_path: str | None, **flags: Any) -> None:
    """Train: defaults < --config FILE.yaml < key=value overrides < flags.

    \b
    ARGS are dotted overrides such as optim.lr=0.05 train.epochs=3 data.batch_size=256
    (or a YAML file as the first argument). data.batch_size is the GLOBAL batch, split over all processes.
    `ignite-mgpu config` prints every key with its default and meaning.
    """
    refuse_unknown_options(args)
    with errors_to_exit():
        cfg = _load(args, config_path, flags)
    from ignite_mgpu.jobs import fit

    sys.exit(fit(cfg))


@main.command("config", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file over the defaults.")
def config_command(args: tuple[str, ...], config_path: str | None) -> None:
    """Print every config key with its value and meaning, as YAML.

    Without arguments: the defaults. With a FILE.yaml and key=value overrides: what train would run with them
    (checked as train checks them).

    \b
        ignite-mgpu config                               # every key, its default and what it means
        ignite-mgpu config > my.yaml                     # a start for your own config: edit, then train my.yaml
        ignite-mgpu config my.yaml optim.lr=0.1          # the configuration that train my.yaml optim.lr=0.1 runs
    """
    refuse_unknown_options(args)
    with errors_to_exit():
        cfg = _load(args, config_path, {}, check=True)
    from ignite_mgpu.config.keys import commented_yaml

    click.echo(commented_yaml(cfg), nl=False)


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option(
    "--checkpoint",
    "checkpoint_path",
    required=True,
    type=click.Path(),  # a folder too: a sharded checkpoint is refused with how to convert it
    help="A best_model_*.pt, checkpoint_*.pt, .safetensors or any (even module.-prefixed) state_dict file.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML of the run (model, data).")
@dist_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def evaluate(args: tuple[str, ...], checkpoint_path: str, config_path: str | None, as_json: bool, **flags: Any) -> None:
    """Evaluate saved weights on the validation split and print accuracy and loss."""
    refuse_unknown_options(args)
    with errors_to_exit():
        cfg = _load(args, config_path, flags)
    from ignite_mgpu.jobs import evaluate as evaluate_job

    sys.exit(evaluate_job(cfg, checkpoint_path, as_json))


@main.command(
    cls=ScriptCommand,
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    epilog=f"Exit codes: {exit_codes_text()}.",
)
@click.argument("script", metavar="SCRIPT")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[SCRIPT ARGS]...")
@click.option("-m", "--module", is_flag=True, help="SCRIPT is a module name, run as python -m MODULE.")
@click.option("--nproc", type=int, help="Processes on this node [default: selected GPUs, or 1 on CPU].")
@click.option(
    "--gpus",
    callback=gpus_value,
    help="Physical GPU ids as nvidia-smi shows them (2,3), all, none, auto, auto:N or auto:MIN-MAX.",
)
@click.option("--nnodes", type=int, default=1, help="Machines in the job (multi-node: also --node-rank, --master-*).")
@click.option("--node-rank", type=int, default=0, help="This machine's index, 0..nnodes-1.")
@click.option("--master-addr", default="127.0.0.1", help="Address of node 0 [default: 127.0.0.1].")
@click.option("--master-port", type=int, help="TCP port on node 0 [default on one node: a free port].")
@click.option(
    "--cpu-binding",
    type=click.Choice(CPU_BINDINGS),
    default="none",
    help="Bind each process to its CPUs: cores (its own share), numa (its GPU's node), auto [none].",
)
@click.option("--max-restarts", type=int, default=0, help="Start every process again after a rank crashed [0].")
@click.option(
    "--preempt-signal",
    default="SIGUSR1",
    callback=preempt_signal,
    help="SLURM's warning before the time limit (sbatch --signal=B:USR1@90, passed on by the batch script): sent "
    "to every process, then the SLURM job is requeued; none: off [SIGUSR1].",
)
@rank_prefix_option(False)
@wait_and_share(share_default=False)
def run(script: str, script_args: tuple[str, ...], module: bool, **flags: Any) -> None:
    """Run your own training SCRIPT (or -m MODULE) in N processes, as torchrun starts them.

    \b
        ignite-mgpu run --nproc 2 train.py --epochs 1
        ignite-mgpu run --gpus 2,3 -m mypkg.train --lr 0.1
        ignite-mgpu run --gpus auto:2 --max-restarts 1 train.py --resume last.pt
        ignite-mgpu run --gpus auto:2 --wait train.py          # in line until 2 GPUs are free

    Each process gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT,
    TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE, ...): init_process_group(), idist.Parallel, launch(), Lightning
    and Accelerate see a torchrun launch. Options go before SCRIPT; what follows it is the script's. A failing rank
    stops every process and its error is shown once (the one @record wrote, where it did); a script that exits with
    2 rejected its arguments and is not restarted. Ctrl-C reaches every process as SIGINT (KeyboardInterrupt),
    SIGTERM as SIGTERM, as torchrun passes them on; SIGKILL 60 s later. GPUs are claimed as train claims them
    (--wait, --share). SLURM's warning before the time limit is passed to every process, then the job is requeued.
    Refused under torchrun or srun: one launcher at a time.
    """
    from ignite_mgpu.config.schema import DistConfig

    with errors_to_exit():
        from ignite_mgpu.processes.script import run_script_job

        cfg = DistConfig(**flags)
        code = run_script_job(cfg, script, list(script_args), module)
    sys.exit(code)


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file over the defaults.")
@click.option("--nproc", type=int, help="Processes to plan for [default: selected GPUs, or 1 on CPU].")
@click.option(
    "--gpus",
    callback=gpus_value,
    help="The GPUs whose free memory counts: physical ids (2,3), all, none, auto or auto:N.",
)
@click.option("--strategy", type=click.Choice(STRATEGIES), help="Checked as train checks it; every strategy is shown.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (bytes as integers).")
def plan(args: tuple[str, ...], config_path: str | None, as_json: bool, **flags: Any) -> None:
    """Estimate a job's memory before it starts, and which strategy and micro-batch fit.

    Per GPU (per CPU process on a CPU job): parameters, gradients, optimizer state, activations per sample and the
    peak of one training step under ddp, dp and fsdp.

    \b
        ignite-mgpu plan my.yaml
        ignite-mgpu plan my.yaml --gpus auto:2 data.batch_size=64 --json

    The step runs on fake tensors on the CPU (the configured model, the first batch's shapes, loss, optimizer and
    precision, the global batch split over the processes): nothing is allocated, no process or GPU is used. It then
    says which strategy, and which train.micro_batch when the whole batch does not fit, fits the selected GPUs'
    free memory (without GPUs: the available RAM, shared by the processes). The peak is within 15 % of a measured
    step on the CPU; the fit keeps that margin free.
    """
    refuse_unknown_options(args)
    with errors_to_exit():
        cfg = _load(args, config_path, flags)
    from ignite_mgpu.jobs import plan_memory

    sys.exit(plan_memory(cfg, as_json))


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file over the defaults.")
@dist_options
@click.option("--iters", "iterations", type=int, default=20, help="Iterations measured at each size, after as many "
              "of warm-up [20].")  # fmt: skip
@click.option(
    "--batch",
    type=click.Choice(["per-process", "global"]),
    default="per-process",
    help="per-process: each process keeps the batch it has at the largest size (the global batch grows, as "
    "published figures measure); global: data.batch_size at every size [per-process].",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def scale(
    args: tuple[str, ...], config_path: str | None, iterations: int, batch: str, as_json: bool, **flags: Any
) -> None:
    """Measure how the job's step scales over 1, 2, ... GPUs (or --nproc CPU processes).

    Prints each size's samples/s, speed-up, scaling efficiency and where the step's time goes, then a verdict: what
    lost the most time, and what helps.

    \b
        ignite-mgpu scale my.yaml --gpus 0,1,2,3         # 1, 2, 3 and 4 GPUs
        ignite-mgpu scale --nproc 2 --iters 50           # 1 and 2 CPU processes

    Each size runs the job's own training step (model, strategy, precision, batch) for --iters iterations of warm-up,
    then --iters measured, in processes started for it: no validation, no checkpoint, no tracker, nothing written to
    a run folder. The GPUs are claimed once for every size, as train claims them (--wait, --share).
    """
    refuse_unknown_options(args)
    with errors_to_exit():
        cfg = _load(args, config_path, flags)
    from ignite_mgpu.scaling import scale as scale_job

    sys.exit(scale_job(cfg, iterations, batch, as_json))


for _command in (devices, stacks, report, checkpoint):
    main.add_command(_command)
