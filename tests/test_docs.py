"""The documentation cannot rot: every shell and Python block in docs/ is a copy of a file the suite runs (kept
equal to it), marked as not runnable here (with the reason), or run here; every YAML block is a valid config; the
generated reference covers every config key. `python -m pytest -q tests/test_docs.py`."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from html import unescape
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docs_blocks import RUNNABLE, all_blocks, doc_block, run_block, sandbox

sys.path.insert(0, str(REPO / "tools"))
from docs_reference import config_keys, exit_codes_page

BLOCKS = all_blocks()
TESTS_SOURCE = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
RUN_HERE = [b for b in BLOCKS if b.lang in RUNNABLE and not b.source and not b.not_run_here and not b.name]
COPIES = [b for b in BLOCKS if b.source]


def test_every_code_block_is_run_or_says_why_not():
    named = [b.name for b in BLOCKS if b.name]
    assert len(named) == len(set(named)), f"a block name is used twice: {named}"
    for block in BLOCKS:
        if block.name:
            assert f'doc_block("{block.name}")' in TESTS_SOURCE, f"{block.id}: no test runs block {block.name}"
        assert not block.title.lower().startswith("not run"), f"{block.id}: a title speaks to the reader"
        assert block.lang != "", f"{block.id}: give the block a language (text for output)"


def test_the_reader_finds_the_blocks():  # a reader that found nothing would make every check above pass
    assert len(BLOCKS) > 30 and len(RUN_HERE) >= 1 and sum(b.name != "" for b in BLOCKS) >= 7
    assert sum(b.not_run_here for b in BLOCKS) >= 5 and len(COPIES) >= 15


def test_no_page_includes_a_file():
    """A page holds its code: a reader of the repository (on a forge, in a clone) sees what the site shows, so no
    include line (pymdownx.snippets' ``--8<--``) stands where the code should be."""
    for page in sorted((REPO / "docs").rglob("*.md")):
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.match(r"\s*;?-+8<-+", line), f"{page.relative_to(REPO)}:{number}: write the code out"


def test_no_page_shows_the_folder_of_a_checkout():
    """Outputs recorded from a run show the reader's kind of paths (an installed package, a project of theirs),
    never the folder that this repository or a copy of it was checked out in."""
    where = f"{REPO.parent}/"
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert where not in line, f"{page.relative_to(REPO)}:{number}: {line.strip()[:100]}"


@pytest.mark.parametrize("block", COPIES, ids=[b.id for b in COPIES])
def test_a_copy_is_its_file(block):
    """A block ``<!-- same as: PATH -->`` is that file of examples/ or configs/ (run by the suite), whole and
    unchanged: the page, the clone and the site show the same code. Its title, when it is a path, names the file
    (the path a tutorial's reader writes it to, relative to the example's folder)."""
    import difflib

    path = REPO / block.source
    assert block.source.startswith(("examples/", "configs/")) and path.is_file(), f"{block.id}: {block.source}?"
    if block.is_file:
        assert block.source.endswith(f"/{block.title}") or block.source == block.title, (block.id, block.title)
    expected = path.read_text()
    diff = "\n".join(difflib.unified_diff(expected.splitlines(), block.text.splitlines(), block.source, block.id))
    assert block.text == expected, f"{block.id} differs from {block.source}: make them equal\n{diff}"


def test_a_tutorials_files_are_copies_of_an_example():
    """What a tutorial has its reader write is an example the suite runs, under one folder of examples/ per page."""
    for page in sorted((REPO / "docs" / "tutorials").glob("*.md")):
        files = [b for b in BLOCKS if b.page == f"tutorials/{page.name}" and b.is_file]
        assert len(files) >= 4 and all(b.source for b in files), [b.id for b in files if not b.source]
        assert len({b.source.removesuffix(b.title) for b in files}) == 1, [b.source for b in files]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("block", RUN_HERE, ids=[b.id for b in RUN_HERE])
def test_block_runs(block, tmp_path):
    run_block(block, sandbox(tmp_path))


YAML_BLOCKS = [b for b in BLOCKS if b.lang == "yaml"]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.id for b in YAML_BLOCKS])
def test_yaml_block_is_a_valid_config(block, tmp_path):
    from ignite_mgpu import load_config

    file = tmp_path / "block.yaml"
    file.write_text(block.text)
    load_config(file)


def test_config_reference_lists_every_key_with_its_default():
    from omegaconf import OmegaConf

    from ignite_mgpu import Config

    def leaves(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and not key.endswith("args"):  # model.args, optim.scheduler_args, ...: leaves
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    expected = dict(leaves(OmegaConf.to_container(OmegaConf.structured(Config))))
    keys = {k.name: k for k in config_keys()}
    assert list(keys) == list(expected)
    assert keys["data.batch_size"].default == str(expected["data.batch_size"])
    assert keys["optim.lr"].type == "float" and "learning rate" in keys["optim.lr"].meaning
    assert all(k.meaning for k in keys.values())


def test_exit_codes_page_is_the_table():
    from ignite_mgpu.errors import EXIT_CODES

    rows = re.findall(r"^\| (\d+) \|", exit_codes_page(), flags=re.M)
    assert [int(r) for r in rows] == list(EXIT_CODES)


def test_slurm_script_is_valid_bash():
    script = REPO / "examples" / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "--resume auto" in script.read_text() and "#SBATCH --signal=USR1@" in script.read_text()


STUB_RUN = """#!/bin/bash
trap 'echo "got USR1" >> "$STUB_LOG"; sleep 0.3; echo ended >> "$STUB_LOG"; exit 138' USR1
echo started > "$STUB_LOG"
if [ -n "${STUB_EXIT:-}" ]; then exit "$STUB_EXIT"; fi
while :; do sleep 0.05; done
"""


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ending", ["signal", 0, 3])
@pytest.mark.parametrize("options", [["-euo", "pipefail"], []])
def test_the_batch_scripts_trap_passes_the_warning_on_and_keeps_the_exit_code(tmp_path, ending, options):
    """The batch script's end in your-own-script.md, run by bash (with and without -e) with a stand-in ignite-mgpu:
    SLURM's B:USR1 reaches the command, the script waits for its end and exits with its code (138); without a
    signal, the command's code."""
    block = doc_block("sbatch-preemption-trap")
    stub = tmp_path / "bin" / "ignite-mgpu"
    stub.parent.mkdir()
    stub.write_text(STUB_RUN)
    stub.chmod(0o755)
    log = tmp_path / "stub.log"
    env = {**os.environ, "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log)}
    if ending != "signal":
        env["STUB_EXIT"] = str(ending)
    # Its own session: the stand-in it starts in the background goes with it, whatever the test's end.
    shell = subprocess.Popen(["bash", *options, "-c", block.text], cwd=tmp_path, env=env, start_new_session=True)
    try:
        if ending == "signal":
            # The command runs and the batch shell has set its trap (SLURM signals a script that has started; a
            # signal before the trap line would end the shell, and the test, by bash's default action).
            while not (log.exists() and catches(shell.pid, signal.SIGUSR1)):
                time.sleep(0.01)
            shell.send_signal(signal.SIGUSR1)  # to the batch shell only, as B: sends it
        assert shell.wait(timeout=30) == (138 if ending == "signal" else ending)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    assert log.read_text().splitlines()[1:] == (["got USR1", "ended"] if ending == "signal" else [])


def documented_names(page: str) -> list[str]:
    """The first column of the tables of a reference page, without backticks."""
    text = (REPO / "docs" / "reference" / page).read_text()
    return [m.strip("`") for m in re.findall(r"^\| (`[^`]+`) \|", text, flags=re.M)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checkpoints_how_to_and_the_files_it_documents(tmp_path):
    """One job (trained, inspected, evaluated, reported) checks the how-to's commands, the metrics.jsonl
    fields and the checkpoint file names of the reference."""
    import json

    result = run_block(doc_block("checkpoints"), sandbox(tmp_path), timeout=220)
    run_dir = tmp_path / "runs" / "ckpt"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1]
    assert set(lines[0]) == set(documented_names("metrics.md"))
    evaluated = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert evaluated["accuracy"] == pytest.approx(lines[0]["val_accuracy"])
    patterns = [
        re.escape(n).replace("<iteration>", r"\d+").replace("<epoch>", r"\d+")
        for n in documented_names("checkpoint-files.md")
    ]
    patterns = [p.replace("<metric>", "val_(accuracy|loss)").replace("<score>", r"[0-9.]+") for p in patterns]
    for path in run_dir.iterdir():
        assert any(re.fullmatch(p.rstrip("/"), path.name) for p in patterns), f"{path.name} is not documented"


def test_troubleshooting_messages_are_what_the_cli_prints(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from ignite_mgpu.cli.commands import main
    from ignite_mgpu.processes import launcher

    monkeypatch.setattr(launcher, "run_job", lambda *args, **kwargs: pytest.fail("a job was started"))
    monkeypatch.chdir(tmp_path)
    text = (REPO / "docs" / "how-to" / "troubleshooting.md").read_text()
    rows = re.findall(r"^\| `ignite-mgpu ([^`]+)`[^|]*\| `([^`]+)` \|$", text, flags=re.M)
    assert len(rows) >= 5
    for command, message in rows:
        result = CliRunner().invoke(main, shlex.split(command), catch_exceptions=False)
        assert result.exit_code == 2 and message in result.output, (command, result.output)


def test_checkpoint_files_page_names_every_file_of_the_code():
    from ignite_mgpu.checkpoint import files
    from ignite_mgpu.runs import folder

    names = set(documented_names("checkpoint-files.md"))
    trackers = (folder.TRACKING_CSV, folder.TRACKER_RUNS, folder.MLFLOW_DB, f"{folder.MLFLOW_ARTIFACTS}/")
    names_in_code = (folder.CONFIG, folder.METRICS, folder.LOCK, folder.REPORT_IMAGE, f"{folder.TENSORBOARD}/")
    for name in (*names_in_code, *trackers, f"{folder.WANDB}/"):
        assert name in names, f"{name} (ignite_mgpu.runs.folder) is missing from docs/reference/checkpoint-files.md"
    page = (REPO / "docs" / "reference" / "checkpoint-files.md").read_text()
    for name in (files.METADATA, files.TRAIN_STATE, files.TEMP_PREFIX):
        assert name in page


# The reference renders as a page people read (mkdocs-click, mkdocstrings, docs/stylesheets/extra.css).


def _commands(group, path=()):
    import click

    for name, command in sorted(group.commands.items()):
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


def test_every_command_summary_is_a_whole_sentence():
    """The first line of a command's help is its summary in the reference's list of subcommands (mkdocs-click
    takes that line): a whole sentence, not one cut where the docstring wraps."""
    from ignite_mgpu.cli.commands import main

    for path, command in _commands(main):
        first = inspect.cleandoc(command.help or "").splitlines()[0]
        assert first.endswith(".") and len(first) <= 116, (path, first)


def test_cli_examples_are_indented_as_code():
    """Example command lines in a help text are indented by 4 spaces: the reference renders them as a code block
    (a \\b paragraph of 2 spaces would run them together in one paragraph); the terminal keeps them as written."""
    from ignite_mgpu.cli.commands import main

    for path, command in _commands(main):
        for line in inspect.cleandoc(command.help or "").splitlines():
            if line.lstrip().startswith("ignite-mgpu "):
                assert line.startswith("    "), (path, line)


def test_the_api_reference_returns_and_raises_are_whole_items():
    """mkdocstrings reads Google-style sections: a Returns whose lines are not indented under its first becomes
    one table row per line; every Raises item names an exception."""
    import importlib

    from griffe import Docstring

    paths = re.findall(r"^::: (\S+)", (REPO / "docs" / "reference" / "api.md").read_text(), flags=re.M)
    assert len(paths) >= 10
    for path in paths:
        module, _, name = path.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError:  # a method: module.Class.name
            module, _, cls = module.rpartition(".")
            obj = getattr(getattr(importlib.import_module(module), cls), name)
        for section in Docstring(inspect.getdoc(obj) or "", parser="google").parse():
            if section.kind.value in ("returns", "yields"):
                assert len(section.value) == 1, (path, [item.description[:40] for item in section.value])
            if section.kind.value == "raises":
                assert all(re.fullmatch(r"[A-Z]\w*(Error|Exit|Failed|Interrupt)", i.annotation) for i in section.value)


def stylesheet() -> dict[str, str]:
    """docs/stylesheets/extra.css as {selector: body}."""
    css = re.sub(r"/\*.*?\*/", "", (REPO / "docs" / "stylesheets" / "extra.css").read_text(), flags=re.S)
    return {selector.strip(): body for selector, body in re.findall(r"([^{}]+)\{([^}]*)\}", css)}


def site_config() -> dict:
    import yaml

    return yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # tags of plugins: as text


# What one line of a code block holds in a 1400 px window (docs/stylesheets/extra.css says the same). Material's rem
# is 20 px there (html at 125% below 1600 px); the window less a 17 px scrollbar is 1383 px, within the grid's 70rem;
# one sidebar (toc.integrate) of 12.1rem and the content's margins of 1.2rem + 0.8rem leave the column. A code
# block's text is 0.85 x 0.8rem, padded by 1.1764705882em on the left and 2.5em on the right; a character of the
# widest usual monospace font (DejaVu Sans Mono; Roboto Mono is 0.6em) is 0.602em.
REM, WINDOW, SCROLLBAR = 20, 1400, 17
CODE_FONT = 0.85 * 0.8 * REM
COLUMN = min(WINDOW - SCROLLBAR, 70 * REM) - 12.1 * REM - (1.2 + 0.8) * REM  # 1101 px
CODE_PADDING = (1.1764705882 + 2.5) * CODE_FONT  # 50 px
FITS = int((COLUMN - CODE_PADDING) // (0.602 * CODE_FONT))  # 128 characters
# Prose is at most 36rem wide; a block in a list item is indented by the list's 0.625em and the item's 1.25em.
FITS_IN_A_LIST = int((36 * REM - (0.625 + 1.25) * 0.8 * REM - CODE_PADDING) // (0.602 * CODE_FONT))  # 78
WRAPS = {"text", "console"}  # output: wraps at the column's edge, each wrapped line hanging


def test_the_stylesheet_makes_the_column_that_the_widths_assume():
    """The rules that the widths above rest on, and those that keep keys whole, are in the stylesheet that the site
    links; output blocks wrap with a hanging indent, one span per line."""
    config, rules = site_config(), stylesheet()
    assert "stylesheets/extra.css" in config["extra_css"]
    assert "toc.integrate" in config["theme"]["features"]
    highlight = next(e["pymdownx.highlight"] for e in config["markdown_extensions"] if "pymdownx.highlight" in e)
    assert highlight["line_spans"] == "__span" and highlight["pygments_lang_class"] == "true"
    assert "max-width: 70rem" in rules[".md-grid"]
    assert "max-width: 36rem" in rules[".md-typeset > :is(p, ul, ol, dl, blockquote)"]
    assert "word-break: normal" in rules[".md-typeset table:not([class]) code"]
    assert "white-space: nowrap" in rules[".md-typeset table:not([class]) td:first-child code"]
    code = rules[".md-typeset pre > code"]
    assert "overflow-x: auto" in code and "white-space: pre" in code and "padding-right: 2.5em" in code
    kinds = ", ".join(f".language-{kind}" for kind in sorted(WRAPS))
    assert "white-space: pre-wrap" in rules[f".md-typeset :is({kinds}) pre > code"]
    line = rules[f'.md-typeset :is({kinds}) pre > code > span[id^="__span"]']
    assert "display: block" in line and "padding-left: 4ch" in line and "text-indent: -4ch" in line


def test_every_line_of_code_fits_the_column():
    """Code is read as written: no line of a code block is wider than the column at 1400 px (it would scroll);
    output (text, console) may be, since it wraps."""
    assert FITS == 128 and FITS_IN_A_LIST == 78  # the arithmetic above, as extra.css states it
    for block in BLOCKS:
        fits = FITS_IN_A_LIST if block.indent else FITS
        if block.lang not in WRAPS:
            long = [line for line in block.text.splitlines() if len(line) > fits]
            assert not long, f"{block.id}: {len(long[0])} characters; {fits} fit (or make it output: text)"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_built_reference_reads_as_a_page(tmp_path):
    """The site built as CONTRIBUTING says (properdocs, strict), quietly: nothing but its INFO lines, no notice to
    scroll past. Then the generated HTML: examples in code blocks, summaries whole, fit's Returns one row, config
    keys in code cells of the key column, the stylesheet linked."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for variable in ("NO_MKDOCS_2_WARNING", "DISABLE_MKDOCS_2_WARNING"):  # quiet without them
        env.pop(variable, None)
    command = ["properdocs", "build", "--strict", "-f", "mkdocs.yml", "--site-dir", str(tmp_path / "site")]
    built = subprocess.run(
        [sys.executable, "-m", *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=170
    )
    assert built.returncode == 0, built.stderr[-3000:]
    said = [line for line in (built.stdout + built.stderr).splitlines() if line.strip()]
    assert said and all(line.startswith("INFO ") for line in said), said
    site = tmp_path / "site" / "reference"
    cli = (site / "cli" / "index.html").read_text()
    assert re.search(r"<pre>.*<code>ignite-mgpu config  +# every key", cli.replace("\n", " ")), "examples not in code"
    summaries = re.findall(r"<li><em><a href=\"#ignite-mgpu-[\w-]+\">[\w-]+</a></em>: (.*?)</li>", cli)
    assert len(summaries) >= 10 and all(s.endswith(".") for s in summaries), summaries
    api = (site / "api" / "index.html").read_text()
    fit = api[api.index('id="ignite_mgpu.jobs.fit"') : api.index('id="ignite_mgpu.jobs.evaluate"')]
    assert fit.count('class="doc-section-item"') == 1  # Returns: one row, whole
    config = (site / "config" / "index.html").read_text()
    assert "stylesheets/extra.css" in config and "<td><code>output_dir</code></td>" in config

    # Every page, generated ones too: a line wider than the column is output, which wraps, one span a line.
    block = re.compile(
        r'<div class="language-(\w+)[^"]*highlight">(?:<span class="filename">[^<]*</span>)?<pre>(.*?)</pre>', re.S
    )
    pages = sorted((tmp_path / "site").rglob("*.html"))
    for page in pages:
        html = page.read_text()
        found = block.findall(html)
        assert len(found) == html.count("<pre"), f"{page}: a code block that is not highlighted"
        for kind, body in found:
            lines = unescape(re.sub(r"<[^>]+>", "", body)).splitlines()
            if any(len(line) > FITS for line in lines):
                assert kind in WRAPS and 'id="__span-' in body, (page, kind, max(lines, key=len))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_scaling_how_to_prints_each_ranks_split(tmp_path):
    result = run_block(doc_block("scaling"), sandbox(tmp_path), timeout=140)
    lines = result.stdout.splitlines()[-3:]
    number = r"[\d.]+"
    for rank, line in enumerate(lines[:2]):
        parts = ", ".join(f"{k} {number}" for k in ("data", "compute", "comm", "optimizer"))
        assert re.fullmatch(rf"rank {rank}: {parts} ms of {number} ms per iteration", line), lines
    assert re.fullmatch(r"slowest rank: [01], bound by: (None|communication|data|slowest_rank)", lines[2]), lines


def test_the_scaling_how_to_shows_what_the_rule_says_of_its_numbers():
    """The slow rank's and the slow link's recorded splits, judged by today's rule, say what the page shows."""
    from ignite_mgpu.runs.bottleneck import Split, judge

    text = (REPO / "docs" / "how-to" / "scaling.md").read_text()
    split = Split([0.336, 170.073], [21.374, 3.195], [158.622, 3.462], [0.391, 0.352], 181.91)
    verdict = judge(split)
    assert verdict.bound_by == "slowest_rank" and f"WARNING step time: {verdict.words}\n" in text
    small = judge(Split([0.21, 0.21], [4.86, 3.59], [2.45, 5.39], [0.62, 0.37], 9.27))
    assert small.bound_by is None and "slowest rank: 0, bound by: None" in text
    link = judge(Split([0.236, 0.243], [10.319, 10.079], [263.034, 261.418], [12.046, 11.135], 286.344), "cpu")
    assert link.bound_by == "communication" and f"WARNING step time: {link.words}\n" in text
