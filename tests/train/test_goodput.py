"""The goodput accounting on real ignite engines in this process: each part measured at event boundaries, the
parts adding up to the wall time, a restart going on from the progress saved with its checkpoint.
`python -m pytest tests/train/test_goodput.py`."""

import json
import time

import pytest
from ignite.engine import Engine, Events

from ignite_mgpu.env.clock import JobClock, command_start, process_start
from ignite_mgpu.runs.goodput_parts import FIELDS, PARTS, read_totals
from ignite_mgpu.train.goodput import Goodput
from ignite_mgpu.train.step.guard import GuardEvents

STEP, SAVE, EVAL = 0.01, 0.03, 0.02  # seconds slept by an iteration, a checkpoint handler, a validation


def job(path, clock, every=4):
    """A trainer of sleeping steps with a checkpoint every ``every`` iterations, validation and an epoch log's
    line at each epoch's end, wired as train/default_job.py wires them. Returns (trainer, goodput, the lines)."""
    trainer, evaluator = Engine(lambda e, b: time.sleep(STEP)), Engine(lambda e, b: None)
    trainer.register_events(*GuardEvents)
    goodput, written = Goodput(path, clock, writer=True), []
    goodput.attach(trainer)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run([0]))
    evaluator.add_event_handler(Events.STARTED, lambda: time.sleep(EVAL))

    def log(engine):  # the epoch log's line, with a data wait of 1 ms
        written.append(goodput.line(0.001, engine.state.iteration))

    trainer.add_event_handler(Events.EPOCH_COMPLETED, log)
    with goodput.timing_checkpoints(trainer, evaluator):
        trainer.add_event_handler(GuardEvents.CHECKPOINT, lambda: time.sleep(SAVE))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=every), lambda e: e.fire_event(GuardEvents.CHECKPOINT))
    return trainer, goodput, written


def test_the_parts_are_measured_and_add_up_to_the_wall_time(tmp_path):
    started = time.time() - 1.0  # the command started a second ago
    trainer, _, lines = job(tmp_path / "goodput.json", JobClock(started))
    trainer.run(range(10), max_epochs=2)
    first, second = lines
    assert first["time_startup_s"] >= 1.0 and second["time_startup_s"] == 0
    for line in lines:
        assert sum(line[FIELDS[p]] for p in PARTS) == pytest.approx(line["time_wall_s"], abs=0.005)  # each rounded
        assert line["time_train_s"] >= 10 * STEP - 0.001 and line["time_data_wait_s"] == 0.001
        assert line["time_eval_s"] >= EVAL and line["redone_iterations"] == 0
        assert line["time_restart_s"] == line["time_lost_s"] == 0
    assert first["time_checkpoint_s"] >= 2 * SAVE and second["time_checkpoint_s"] >= 3 * SAVE  # 4, 8; 12, 16, 20
    assert second["run_time_s"] == pytest.approx(first["time_wall_s"] + second["time_wall_s"], abs=0.005)
    records = json.loads((tmp_path / "goodput.json").read_text())["records"]  # the trainer's, not the evaluator's
    assert [r["iteration"] for r in records] == [4, 8, 10, 12, 16, 20, 20, 20]  # the last 8: saves, lines, the end
    totals = read_totals(tmp_path, [])  # goodput.json: up to the run's end, after the last line
    assert totals["time_wall_s"] >= second["run_time_s"]
    assert time.time() - started - 0.5 <= totals["time_wall_s"] <= time.time() - started + 0.001  # to its end
    wall = totals["time_wall_s"]  # goodput is rounded to 4 decimals, the seconds to 3
    assert totals["goodput"] == pytest.approx(totals["time_train_s"] / wall, abs=0.0005 / wall + 0.00005)


def test_a_restart_goes_on_from_the_progress_saved_with_its_checkpoint(tmp_path):
    path = tmp_path / "goodput.json"
    trainer, _, lines = job(path, JobClock(time.time()))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=15), lambda e: e.terminate())  # "fails" in 15
    trainer.run(range(10), max_epochs=2)
    at_12 = next(r for r in json.loads(path.read_text())["records"] if r["iteration"] == 12)
    failed_at = time.time()
    time.sleep(0.05)  # the supervisor's restart

    restarted, _, after = job(path, JobClock(time.time() - 10, failed_at=failed_at, reached=14))
    restarted.load_state_dict({"iteration": 12, "epoch_length": 10, "max_epochs": 2})  # resumed from checkpoint_12
    restarted.run(range(10))
    (second,) = after
    assert second["redone_iterations"] == 2 and second["time_startup_s"] == 0
    assert second["time_lost_s"] == pytest.approx(failed_at - at_12["at"], abs=0.002)
    assert second["time_restart_s"] >= 0.05
    assert second["time_train_s"] >= 10 * STEP - 0.001  # 11-12 before the failure, 13-20 after it
    assert second["run_time_s"] == pytest.approx(lines[0]["time_wall_s"] + second["time_wall_s"], abs=0.005)
    totals = read_totals(tmp_path, [])
    assert totals["redone_iterations"] == 2  # once, though the restart's own progress was saved since


def test_without_anchors_the_clock_is_the_commands_start():
    from ignite_mgpu.env.clock import job_clock

    assert job_clock() == JobClock(command_start()) and process_start() <= command_start() <= time.time()


def test_nothing_is_timed_per_iteration(tmp_path):
    """Only event boundaries: no handler on an iteration's or a batch's events."""
    trainer, evaluator = Engine(lambda e, b: None), Engine(lambda e, b: None)
    trainer.register_events(*GuardEvents)
    goodput = Goodput(tmp_path / "goodput.json", JobClock(time.time()), writer=True)
    goodput.attach(trainer)
    with goodput.timing_checkpoints(trainer, evaluator):
        pass
    per_iteration = (Events.ITERATION_STARTED, Events.ITERATION_COMPLETED, Events.GET_BATCH_STARTED)
    for engine in (trainer, evaluator):
        assert all(not engine._event_handlers[e] for e in (*per_iteration, Events.GET_BATCH_COMPLETED))


def test_a_restart_on_fewer_processes_is_counted_as_a_change_of_size(tmp_path):
    path = tmp_path / "goodput.json"
    trainer, _, _ = job(path, JobClock(time.time()))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=15), lambda e: e.terminate())
    trainer.run(range(10), max_epochs=2)
    failed_at = time.time()
    time.sleep(0.05)  # the supervisor leaves out the failed GPU and restarts on the rest
    clock = JobClock(time.time() - 10, failed_at=failed_at, reached=14, resized_from=4)
    restarted, _, after = job(path, clock)
    restarted.load_state_dict({"iteration": 12, "epoch_length": 10, "max_epochs": 2})
    restarted.run(range(10))
    (second,) = after
    assert second["time_resize_s"] >= 0.05 and second["time_restart_s"] == 0 and second["redone_iterations"] == 2
    assert sum(second[FIELDS[p]] for p in PARTS) == pytest.approx(second["time_wall_s"], abs=0.005)
