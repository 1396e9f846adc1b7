"""The end of a run as a person reads it (runs/closing.py): three lines, and the stop line's checkpoint.

pytest tests/runs/test_closing.py -q
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ignite_mgpu.config.loading import load_config
from ignite_mgpu.errors import TrainingInterrupted
from ignite_mgpu.runs.closing import closing_lines, go_on_command, stopped_line


def test_three_lines_where_the_run_is_its_best_model_and_what_next(tmp_path: Path) -> None:
    best = tmp_path / "best_model_3_val_accuracy=0.9820.pt"
    where, model, then = closing_lines(tmp_path, best, epochs=3, run_time_s=10.74)
    assert where.startswith(f"finished: 3 epochs in 10.7 s; the run is in {tmp_path}/")
    assert model == f"best model: {best} (val_accuracy 0.9820, epoch 3)"
    assert f"`ignite-mgpu report {tmp_path}`" in then
    assert f"`ignite-mgpu evaluate --config {tmp_path / 'config.yaml'} --checkpoint {best}`" in then
    assert f"`ignite-mgpu train {tmp_path / 'config.yaml'} --resume auto train.epochs=6`" in then
    assert "{" not in where + model + then  # no JSON: the figures are in metrics.jsonl


def test_without_a_best_model_the_lines_say_so_and_evaluate_is_not_offered(tmp_path: Path) -> None:
    where, model, then = closing_lines(tmp_path, None, epochs=1, run_time_s=2.0)
    assert where.startswith("finished: 1 epoch in 2.0 s") and model.startswith("best model: none saved")
    assert "evaluate" not in then and "--resume auto train.epochs=2" in then


def test_the_suggested_commands_quote_a_folder_with_spaces_and_parse_back(tmp_path: Path) -> None:
    out = tmp_path / "my runs" / "a b"
    argv = shlex.split(go_on_command(out))
    assert argv == ["ignite-mgpu", "train", str(out / "config.yaml"), "--resume", "auto"]


def test_the_stop_line_names_the_checkpoint_and_how_to_go_on(tmp_path: Path) -> None:
    saved = tmp_path / "checkpoint_96.pt"
    err = TrainingInterrupted(2, 96, stopped_line(tmp_path, saved))
    assert str(err).startswith("stopped by SIGINT at iteration 96; every rank stopped at the same iteration; ")
    assert f"last checkpoint {saved}; go on from it with `{go_on_command(tmp_path)}`" in str(err)
    assert (err.exit_code, err.signum, err.iteration) == (130, 2, 96)
    assert "no checkpoint" in stopped_line(tmp_path, None)


def test_the_go_on_command_loads_the_run_config_it_names(tmp_path: Path) -> None:
    from ignite_mgpu.config.loading import dump_config

    cfg = load_config(None, [f"output_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    argv = shlex.split(go_on_command(tmp_path))
    resumed = load_config(argv[2], ["resume=auto"])
    assert resumed.output_dir == str(tmp_path) and resumed.resume == "auto"
