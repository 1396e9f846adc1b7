"""The hang watch's rule (hangs/watch.py), on made-up statuses and times: no process is started."""

from __future__ import annotations

from ignite_mgpu.hangs.watch import HangWatch


def feed(watch: HangWatch, rows: list[tuple[float, dict]]):
    """Observe each (time, {rank: status}); the first Silence found, with the time it was found at."""
    for now, statuses in rows:
        silence = watch.observe(statuses, now)
        if silence is not None:
            return now, silence
    return None


def steps(start: float, count: int, every: float, ranks=(0, 1), beats=1) -> list[tuple[float, dict]]:
    return [(start + i * every, {r: (i + 1, False, beats) for r in ranks}) for i in range(count)]


def test_not_judged_before_the_first_iteration():
    """The trainer's start to the first iteration (a compilation, the loader's start) may take minutes."""
    watch = HangWatch(3.0)
    assert feed(watch, [(t, {0: (0, False, 0), 1: None}) for t in range(0, 100, 5)]) is None
    assert feed(watch, [(t, {0: (0, False, 1), 1: (0, False, 1)}) for t in range(100, 400, 5)]) is None
    # ... and it counts as the job's pace: 300 s, so a 3000 s window.
    assert feed(watch, [(400.0, {0: (1, False, 1), 1: (1, False, 1)}), (3000.0, {0: (1, False, 1)})]) is None
    assert feed(watch, [(3401.0, {0: (1, False, 1)})]) is not None


def test_silent_past_the_floor_is_a_hang_naming_each_ranks_iteration():
    watch = HangWatch(3.0)
    rows = [(0.0, {0: (0, False, 1), 1: (0, False, 1)}), *steps(0.2, 5, 0.1)]
    rows += [(t, {0: (5, False, 1), 1: (5, False, 1)}) for t in (2.0, 3.0, 4.0, 5.0, 6.0)]
    found = feed(watch, rows)
    assert found is not None
    now, silence = found
    assert now == 4.0 and silence.window == 3.0  # silent since 0.6 s and silence.iterations == {0: 5, 1: 5}
    # The first interval (start -> first iteration) is the slowest so far.
    assert silence.slowest == 0.2


def test_window_is_ten_times_the_slowest_interval():
    watch = HangWatch(3.0)
    rows = [(0.0, {0: (0, False, 1)}), *steps(1.0, 3, 2.0, ranks=(0,))]  # 2 s per step: a 20 s window
    last = rows[-1][0]
    assert feed(watch, [*rows, (last + 19.0, {0: (3, False, 1)})]) is None
    found = feed(watch, [(last + 20.5, {0: (3, False, 1)})])
    assert found is not None and found[1].window == 20.0


def test_one_rank_progressing_keeps_the_job_alive():
    """A long evaluation on rank 0 (its beats) while rank 1 waits: the job is not hung."""
    watch = HangWatch(3.0)
    rows = [(0.0, {0: (0, False, 1), 1: (0, False, 1)}), (0.5, {0: (1, False, 1), 1: (1, False, 1)})]
    rows += [(1.0 + i, {0: (1, False, 2 + i), 1: (1, False, 1)}) for i in range(30)]
    assert feed(watch, rows) is None


def test_nobody_is_judged_while_a_rank_saves_and_the_save_is_not_pace():
    watch = HangWatch(3.0)
    rows = [(0.0, {0: (0, False, 1), 1: (0, False, 1)}), (0.2, {0: (1, False, 1), 1: (1, False, 1)})]
    rows += [(0.3 + i, {0: (1, True, 2), 1: (1, False, 1)}) for i in range(60)]  # a 60 s save on rank 0
    assert feed(watch, rows) is None
    found = feed(watch, [(t, {0: (1, False, 3), 1: (1, False, 1)}) for t in (62.0, 63.0, 64.0, 65.5)])
    assert found is not None and found[1].window == 3.0  # the save did not stretch the window


def test_zero_turns_the_watch_off():
    watch = HangWatch(0.0)
    rows = [(0.0, {0: (0, False, 1)}), (1.0, {0: (1, False, 1)}), (1000.0, {0: (1, False, 1)})]
    assert feed(watch, rows) is None
