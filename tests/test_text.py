"""How figures are written for people (ignite_mgpu/text.py). `python -m pytest tests/test_text.py`."""

from ignite_mgpu import text


def test_a_score_is_written_as_the_epoch_line_writes_it():
    # `ignite-mgpu evaluate` printed `loss: 0.15407965087890624`.
    assert [text.score(v) for v in (0.15407965087890624, 0.982, 0.0, 3.0)] == ["0.1541", "0.9820", "0.0000", "3.0000"]
    assert [text.score(v) for v in (1.2345e-5, -2.5e-7, 123456.7)] == ["1.234e-05", "-2.5e-07", "1.235e+05"]
    assert [text.score(v) for v in (101, "runs/a/best.pt")] == ["101", "runs/a/best.pt"]
