"""Messages made clear: YAML errors with their line and column, a duplicate key named; a stop cut short while its
checkpoint was being written never names an iteration as if it had stopped there. `python -m pytest tests/hostile`."""

from __future__ import annotations

import pytest

from ignite_mgpu.config.loading import load_config
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.processes.outcome import Outcome, cut_short_before_stop, cut_short_while_saving


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("data:\n  batch_size: 8\n  batch_size: 16\n", "at line 3, column 3: found duplicate key batch_size"),
        ("data:\n  batch_size: [8\ntrain:\n  epochs: 2\n", "at line 3, column 6: did not find expected ',' or ']'"),
        ("data:\n\tbatch_size: 8\n", "at line 2, column 1: found character that cannot start any token"),
    ],
)
def test_yaml_errors_name_their_line_and_what_is_wrong(tmp_path, text, message):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(tmp_path / "c.yaml")
    assert message in str(info.value)


def test_a_stop_cut_short_while_saving_names_no_iteration():
    stopped = Outcome(130, "stopped by SIGINT at iteration 16; every rank stopped at the same iteration.")
    cut = cut_short_while_saving(stopped, saving=True)
    assert cut.code == 130 and "iteration 16" not in cut.message()
    assert cut.cause == ("stopped by SIGINT, at once, while a checkpoint was being written: it was not written.")
    assert "--resume auto continues from the last complete checkpoint" in cut.message()
    assert cut_short_while_saving(stopped, saving=False) == stopped  # written: the iteration is true
    failed = Outcome(1, "rank 1 failed with RuntimeError: boom")
    assert cut_short_while_saving(failed, saving=True) == failed


def test_a_stop_cut_short_before_the_ranks_stopped_says_the_checkpoint_was_skipped_and_how_to_go_on():
    stopped = Outcome(143, "stopped by SIGTERM.")
    cut = cut_short_before_stop(stopped, "a second signal")
    assert cut.message() == (
        "stopped by SIGTERM, at once (a second signal), before the ranks stopped by themselves: the stop's checkpoint "
        "was not written. --resume auto continues from the last complete checkpoint."
    )
    grace = cut_short_before_stop(stopped, "they did not stop within dist.stop_grace=5 s")
    assert grace.cause.startswith("stopped by SIGTERM, at once (they did not stop within dist.stop_grace=5 s), ")
    failed = Outcome(1, "rank 1 failed with RuntimeError: boom")
    assert cut_short_before_stop(failed, "a second signal") == failed
