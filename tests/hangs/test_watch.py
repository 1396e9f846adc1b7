"""The hang watch's rule (hangs/watch.py), on made-up statuses and times: no process is started."""

from __future__ import annotations

from pathlib import Path

from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.hangs.watch import FIRST_STEP, HangWatch, hang_cause


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


def set_up(t: float, waypoints: dict[int, int]) -> tuple[float, dict]:
    """No rank completed an iteration; each rank's waypoints passed (1: the model built, 2: the trainer started,
    3: the first batch in hand), its activity 1 once its trainer started."""
    return t, {rank: (0, False, int(w >= 2), w) for rank, w in waypoints.items()}


def test_before_the_first_iteration_a_rank_behind_is_judged_at_twice_the_floor():
    """Rank 1's first read (the model's example input) is stuck; rank 0 built its model and waits in DDP's
    broadcast."""
    watch = HangWatch(3.0)
    rows = [set_up(0.0, {0: 0, 1: 0}), set_up(1.0, {0: 1, 1: 0})]
    rows += [set_up(1.0 + 0.5 * i, {0: 1, 1: 0}) for i in range(1, 20)]
    found = feed(watch, rows)
    assert found is not None
    now, silence = found
    assert now == 7.5 and silence.window == 6.0 and silence.behind == (1,), silence  # 6 s after rank 0 moved
    assert silence.iterations == {0: 0, 1: 0}
    assert "before its first iteration: rank(s) 1 stayed behind the others" in hang_cause(silence)
    assert "2 x dist.hang_seconds, 6 s" in hang_cause(silence)


def test_a_rank_without_its_first_batch_is_judged_the_same_way():
    watch = HangWatch(3.0)
    rows = [set_up(0.0, {0: 2, 1: 2}), set_up(2.0, {0: 3, 1: 2}), set_up(8.0, {0: 3, 1: 2})]
    assert feed(watch, rows) is None
    found = feed(watch, [set_up(8.5, {0: 3, 1: 2})])
    assert found is not None and found[1].behind == (1,)


def test_set_up_or_a_first_step_slow_on_every_rank_is_not_judged():
    """A long model build, then a long compilation: the ranks pass each waypoint together; nobody waits long."""
    watch = HangWatch(3.0)
    rows = [set_up(float(t), {0: 0, 1: 0}) for t in range(0, 600, 10)]
    rows += [set_up(600.0, {0: 1, 1: 0}), set_up(601.0, {0: 1, 1: 1}), set_up(602.0, {0: 2, 1: 2})]
    rows += [set_up(float(t), {0: 3, 1: 3}) for t in range(603, 3600, 10)]
    assert feed(watch, rows) is None
    # Its first iteration then counts as the job's pace (an interval of almost an hour): no alarm after it either.
    assert feed(watch, [(3600.0, {0: (1, False, 1, 3), 1: (1, False, 1, 3)}), (3700.0, {0: None})]) is None


def test_a_rank_that_catches_up_within_the_window_is_not_judged():
    watch = HangWatch(3.0)
    rows = [set_up(0.0, {0: 1, 1: 0}), set_up(5.5, {0: 1, 1: 0})]
    rows += [set_up(t, {0: 1, 1: 1}) for t in (6.0, 30.0, 60.0)]
    assert feed(watch, rows) is None
    assert feed(HangWatch(0.0), [set_up(t, {0: 1, 1: 0}) for t in (0.0, 100.0, 1000.0)]) is None  # off


def test_the_default_bounds_are_two_and_five_minutes():
    """A rank behind the others before the first iteration is reported after 2 x dist.hang_seconds (120 s) by
    default; any collective, the set-up's and the first step's included, ends the job after dist.timeout (300 s);
    the how-to page says so."""
    dist = DistConfig()
    assert (FIRST_STEP * dist.hang_seconds, dist.timeout) == (120.0, 300.0)
    page = (Path(__file__).parents[2] / "docs" / "how-to" / "hangs.md").read_text()
    assert "2 x dist.hang_seconds" in page and "120 s" in page and "300 s" in page


def test_quiet_tells_when_a_rank_last_moved_after_the_first_iteration_and_not_while_one_saves():
    # The start of a quiet spell: once per spell the supervisor looks at the ranks' stacks (HangChecks._mismatched).
    watch = HangWatch(60.0)
    watch.observe({0: (0, False, 1), 1: (0, False, 1)}, 0.0)
    assert watch.quiet() is None  # before the first iteration: the waypoints' rule
    feed(watch, steps(1.0, 3, 0.5))
    assert watch.quiet() == (2.0, 1.0)  # the last move at 2.0; the slowest interval: the start to the first, 1 s
    watch.observe({0: (3, False, 1), 1: (3, False, 1)}, 9.0)
    assert watch.quiet() == (2.0, 1.0)  # no move since
    watch.observe({0: (3, True, 1), 1: (3, False, 1)}, 10.0)
    assert watch.quiet() is None  # rank 0 saves: the others wait for it
    assert HangWatch(0.0).quiet() is None  # the watch is off
