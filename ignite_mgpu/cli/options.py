"""The ``ignite-mgpu`` command's shared flags and their parsing: the flag -> config key table, the process and GPU
flags of ``train`` and ``evaluate``, ``--wait``'s and ``--preempt-signal``'s values, the one-line error and the
hint for a flag a command lacks. Torch-free, as the commands."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import click

from ignite_mgpu.config.schema import BACKENDS, CPU_BINDINGS, STRATEGIES

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
    "cpu_binding": "dist.cpu_binding",
    "max_restarts": "dist.max_restarts",
    "share": "dist.share",
    "wait": "dist.wait",
    "rank_prefix": "dist.rank_prefix",
    "output_dir": "output_dir",
    "resume": "resume",
    "seed": "seed",
}


def fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"ignite-mgpu: error: {message}", err=True)
    sys.exit(code)


def _seconds(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """--wait's value: seconds, or inf for no limit (the flag alone)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise click.BadParameter(
            f"{value!r} is not a number of seconds > 0. Give --wait alone (no limit) or --wait SECONDS, and put it "
            "after the key=value overrides or before another flag."
        )
    return seconds


def gpus_value(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--gpus's value, checked against its grammar here, as typed (YAML would read 0x1 as GPU 1 and '' as unset),
    and passed on in its plain form (010 as 10, never YAML's octal 8)."""
    from ignite_mgpu.errors import ConfigError
    from ignite_mgpu.gpus.selection import parse_gpus

    if value is None:
        return None
    try:
        kind, arg = parse_gpus(value)
    except ConfigError as err:
        raise click.BadParameter(str(err).removeprefix("--gpus ")) from None
    if kind == "ids":
        return ",".join(map(str, arg))  # type: ignore[arg-type]  # ids: a list
    return kind if arg is None else f"{kind}:{arg}"


def preempt_signal(ctx: click.Context, param: click.Parameter, value: str) -> str | None:
    """--preempt-signal's value: a signal's name (USR1 or SIGUSR1), or None for none."""
    from ignite_mgpu.config.checks import PREEMPT_SIGNAL_RULE, signal_name, usable_preempt_signal

    if value.lower() in ("none", "null", "off"):
        return None
    if not usable_preempt_signal(value):
        raise click.BadParameter(f"{value!r}: {PREEMPT_SIGNAL_RULE}, or none.")
    return signal_name(value)


def wait_and_share(share_default: bool | None = None) -> Callable[[Any], Any]:
    """--wait [SECONDS] and --share, as ``train`` and ``run`` both have them (gpus/acquire.py: the claims, the
    line). ``share_default``: None where an unset flag must leave the config's value alone."""
    options = [
        click.option(
            "--wait",
            is_flag=False,
            flag_value="inf",
            callback=_seconds,
            metavar="[SECONDS]",
            help="Wait (up to SECONDS; alone: no limit) until the GPUs are free, in line with other waiting jobs.",
        ),
        click.option(
            "--share", is_flag=True, default=share_default, help="Run on GPUs that other jobs claim, and claim none."
        ),
    ]

    def decorate(fn: Any) -> Any:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


class ScriptCommand(click.Command):
    """``run``: everything after SCRIPT is the script's, so ``--wait`` directly before it is the flag alone (no
    limit), not a wait of "train.py" seconds (click gives an optional value the next word that is not an option)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _wait_alone_before_the_script(self, args))


def _wait_alone_before_the_script(command: click.Command, args: list[str]) -> list[str]:
    """``args`` with ``--wait WORD`` written ``--wait=inf WORD`` where WORD is not a number (the script), among the
    options before the script."""
    takes_value = {o for p in command.params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
    args, i = list(args), 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] == "--wait" and i + 1 < len(args) and not args[i + 1].startswith("-"):
            try:
                float(args[i + 1])
            except ValueError:
                args[i] = "--wait=inf"
            else:
                i += 1  # its value
        elif args[i] in takes_value and args[i] != "--wait":
            i += 1  # the option's value
        i += 1
    return args


def rank_prefix_option(default: bool | None) -> Callable[[Any], Any]:
    """--rank-prefix, as ``train``, ``evaluate`` and ``run`` have it. ``default``: None where an unset flag must
    leave the config's value alone."""
    return click.option(
        "--rank-prefix",
        is_flag=True,
        default=default,
        help="Begin each line a process writes with its rank, [rank1]: (every line is relayed whole either way).",
    )


def dist_options(fn: Any) -> Any:
    """The process/GPU flags shared by ``train`` and ``evaluate``."""
    options = [
        click.option("--nproc", type=int, help="Processes on this node [default: selected GPUs, or 1 on CPU]."),
        click.option("--backend", type=click.Choice(BACKENDS), help="auto = nccl with CUDA, else gloo."),
        click.option(
            "--gpus",
            callback=gpus_value,
            help="Physical GPU ids as nvidia-smi shows them (2,3), all, none, auto, auto:N or auto:MIN-MAX.",
        ),
        click.option(
            "--strategy",
            type=click.Choice(STRATEGIES),
            help="ddp: a process per GPU (default); dp: one process with nn.DataParallel; fsdp: a process per GPU, "
            "parameters, gradients and optimizer state sharded over them (FSDP2).",
        ),
        click.option("--nnodes", type=int, help="Machines in the job (multi-node: also --node-rank, --master-*)."),
        click.option("--node-rank", type=int, help="This machine's index, 0..nnodes-1."),
        click.option("--master-addr", help="Address of node 0 [default: 127.0.0.1]."),
        click.option(
            "--master-port", type=int, help="TCP port on node 0 (one node without it: private file rendezvous)."
        ),
        click.option(
            "--timeout", type=float, help="Seconds any collective may wait, from the start (first step included) [300]."
        ),
        click.option(
            "--cpu-binding",
            type=click.Choice(CPU_BINDINGS),
            help="Bind each process to its CPUs: cores (its own share), numa (its GPU's node), auto [none].",
        ),
        rank_prefix_option(None),
    ]
    fn = wait_and_share()(fn)
    for option in reversed(options):
        fn = option(fn)
    return fn


def refuse_unknown_options(args: tuple[str, ...]) -> None:
    """A flag the command lacks, with the one it meant (``--gpu``: ``--gpus``) or the dotted override that sets
    the config key of that name (``--epochs 3``: ``train.epochs=3``)."""
    import difflib

    from ignite_mgpu.config.loading import dotted_keys

    command = click.get_current_context().command
    options = sorted({o for p in command.params for o in p.opts if o.startswith("--")})
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        # click reads `--wait -1` as --wait alone, then an option named -1.
        if re.fullmatch(r"-[\d.]+", arg) and click.get_current_context().params.get("wait") == float("inf"):
            fail(f"--wait {arg}: not a number of seconds > 0. Give --wait alone (no limit) or --wait SECONDS.")
        flag, _, inline = arg.partition("=")
        meant = difflib.get_close_matches(flag, options, n=1, cutoff=0.8)
        name = flag.lstrip("-").replace("-", "_")
        keys = [k for k in dotted_keys() if k.rpartition(".")[2] == name]
        if meant:
            fail(f"no such option: {flag}; did you mean {meant[0]}? (see ignite-mgpu {command.name} --help)")
        if keys:
            given = args[i + 1] if i + 1 < len(args) and "=" not in args[i + 1] else "VALUE"
            fail(
                f"no such option: {flag}. Config keys are set as key=value after the command: did you mean "
                f"{keys[0]}={inline or given}? (`ignite-mgpu config` lists every key)"
            )
        fail(f"no such option: {flag} (see ignite-mgpu {command.name} --help).")


@contextlib.contextmanager
def errors_to_exit() -> Iterator[None]:
    """A ConfigError or CheckpointError raised inside: its paragraph (after the user's traceback it carries), and
    the command exits with its code (2 for a mistake), never a traceback of ours."""
    from ignite_mgpu.errors import CheckpointError, ConfigError

    try:
        yield
    except (ConfigError, CheckpointError) as err:
        if detail := getattr(err, "detail", ""):
            click.echo(detail.rstrip(), err=True)  # e.g. the traceback of the user's own factory
        fail(str(err), err.exit_code)
