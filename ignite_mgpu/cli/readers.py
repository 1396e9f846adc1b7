"""The commands that read what is there, beside the ones that start jobs (``commands.py``): the GPUs and their claims
(``devices``), a live job's stacks (``stacks``), run folders (``report``) and checkpoint files (``checkpoint
inspect``/``convert``). Torch is imported lazily, as in ``commands.py``."""

from __future__ import annotations

import os

import click

from ignite_mgpu.cli.options import errors_to_exit


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def devices(as_json: bool) -> None:
    """List every GPU, its processes, the job that claims it and how the GPUs are linked.

    For each: physical id, PCI bus, memory, utilisation, processes and their users, the job that claims it, its
    CUDA index here, and its links to the others (NVLink, PCIe, across CPU sockets: nvidia-smi topo -m's names) with
    its NUMA node."""
    from ignite_mgpu.gpus import inventory
    from ignite_mgpu.gpus.devices import format_devices, who_has

    snapshot = inventory.query_gpus()
    click.echo(format_devices(snapshot, os.environ, as_json=as_json, claims=who_has(snapshot, os.environ)))


@click.command()
@click.argument("target", metavar="RUN_DIR|PID")
def stacks(target: str) -> None:
    """Print every rank's Python stacks of a live job, without stopping it.

    RUN_DIR: a train job's run folder; PID: the pid of the ignite-mgpu train or run command. Every thread of each
    rank is shown, then its data-loader workers forked from it; a rank stuck in C code (a collective, a sleep)
    answers too (faulthandler, on a signal), and a stopped (SIGSTOP) rank is named as such.
    """
    with errors_to_exit():
        from ignite_mgpu.hangs.stacks import dump, format_dumps, live_ranks

        ranks = live_ranks(target)
    click.echo(format_dumps(dump(ranks)))


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False), metavar="RUN_DIR...")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    help="Image file [default: RUN_DIR/report.png for one run, ./report.png for several].",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of the table.")
def report(run_dirs: tuple[str, ...], out: str | None, as_json: bool) -> None:
    """Draw runs (their metrics.jsonl and config.yaml) into one PNG and print their figures as a table.

    \b
    Panels: training and validation loss, validation accuracy, samples/s and data-wait share per epoch, and
    the peak memory of each GPU (dp) or process (ddp) in the last epoch with its max/min ratio, and where each
    run's wall time went (goodput: start-up, training, data wait, evaluation, checkpoints, restarts). Several
    RUN_DIRs are overlaid, each named by its folder, strategy and process count; a folder of runs (runs/) stands
    for every run in it. Where matplotlib (a
    dependency) cannot be imported, only the table is printed. Reads files only: safe while a run is going.
    """
    with errors_to_exit():
        from ignite_mgpu.runs.figure import write_image
        from ignite_mgpu.runs.read import read_runs
        from ignite_mgpu.runs.report import format_table, to_json

        found = read_runs(run_dirs)
        image, note = write_image(found, out)
    click.echo(to_json(found, image) if as_json else format_table(found))
    click.echo(note, err=True)


@click.group()
def checkpoint() -> None:
    """Inspect or convert checkpoint files, safetensors files and sharded folders.

    .pt files are always loaded with weights_only=True."""


@checkpoint.command()
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect(path: str, as_json: bool) -> None:
    """Show what a checkpoint file or sharded folder holds.

    Its entries, step, parameters, dtypes and wrapper prefixes (of a .safetensors file: its metadata and tied names
    too)."""
    import json

    with errors_to_exit():
        from ignite_mgpu.checkpoint.tools import describe

        info = describe(path)
    click.echo(json.dumps(info, indent=2) if as_json else "\n".join(f"{k}: {v}" for k, v in info.items()))


@checkpoint.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path(dir_okay=False))
def convert(src: str, dst: str) -> None:
    """Write a clean model state_dict (no module./_orig_mod. prefixes) from SRC into DST.

    SRC is a checkpoint, state_dict or .safetensors file, or a sharded checkpoint folder (checkpoint.format=sharded),
    whose shards are gathered here, in one process, into one file that loads anywhere. A DST ending in .safetensors
    is written as safetensors (no pickle; tied weights once; the run's model settings as metadata), any other name
    with torch.save.
    """
    from pathlib import Path

    with errors_to_exit():
        from ignite_mgpu.checkpoint.tools import convert as convert_file

        found = convert_file(src, dst)
    if Path(src).is_dir():
        click.echo(f"wrote {dst} (the model of sharded checkpoint {src})")
        return
    click.echo(f"wrote {dst}" + (f" (stripped {' and '.join(found)})" if found else " (no prefix found)"))
