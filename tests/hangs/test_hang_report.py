"""A hang's report (hangs/hang_report.py) from faulthandler's text: the stuck frame, the collective, the
outcome's wording, the file, the NCCL Flight Recorder's dumps. No process is started."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sysconfig
from pathlib import Path

from ignite_mgpu.errors import FAILED
from ignite_mgpu.hangs import hang_report
from ignite_mgpu.hangs.hang_report import Hang, RankInfo, is_library, summary, where
from ignite_mgpu.hangs.watch import Silence, hang_cause
from ignite_mgpu.processes.outcome import Outcome, with_hang

TORCH = os.path.dirname(importlib.util.find_spec("torch").origin)
OURS = os.path.dirname(os.path.dirname(hang_report.__file__))
STDLIB = sysconfig.get_paths()["stdlib"]
SITE = sysconfig.get_paths()["purelib"]


def dump(*frames: tuple[str, int, str], thread: str = "Current thread 0x00007f43") -> str:
    lines = [f"{thread} (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {function}' for file, line, function in frames]
    return "\n".join(lines) + "\n"


BOTTOM = [(f"{OURS}/processes/worker.py", 312, "worker_main"), (f"{STDLIB}/multiprocessing/process.py", 108, "run")]
IN_LOADER = dump(
    ("/home/me/project/data.py", 35, "__getitem__"),
    (f"{TORCH}/utils/data/dataloader.py", 785, "_next_data"),
    (f"{OURS}/train/data/loaders.py", 55, "__iter__"),
    *BOTTOM,
)
IN_GATHER = dump(
    (f"{TORCH}/distributed/distributed_c10d.py", 4100, "all_gather"),
    (f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper"),
    (f"{OURS}/train/step/guard.py", 54, "gather_checks"),
    *BOTTOM,
)


def test_frames_of_libraries_and_of_the_user():
    assert is_library(f"{TORCH}/nn/modules/module.py") and is_library(f"{STDLIB}/threading.py")
    assert is_library(f"{OURS}/train/step/guard.py") and is_library("<frozen importlib._bootstrap>")
    assert not is_library("/home/me/project/data.py") and not is_library(f"{SITE}/PIL/Image.py")


def test_where_names_the_users_frame_and_the_collective():
    loader = where(IN_LOADER)
    assert str(loader.frame) == "/home/me/project/data.py:35 in __getitem__" and loader.collective is None
    gather = where(IN_GATHER)
    assert (
        gather.collective == "all_gather" and str(gather.called_at) == f"{OURS}/train/step/guard.py:54 in gather_checks"
    )


def test_the_main_thread_is_the_one_running_the_worker():
    other = dump(("/home/me/project/monitor.py", 3, "poll"), thread="Thread 0x00007f11")
    assert str(where(other + "\n" + IN_LOADER).frame).endswith("data.py:35 in __getitem__")


def test_summary_tells_the_stuck_rank_from_the_waiting_one():
    info = {0: RankInfo(10, 2, 6), 1: RankInfo(11, 3, 6)}
    stuck, lines = summary({0: IN_GATHER, 1: IN_LOADER}, info, {0: "nccl:all_gather #7 (process group 0) started"})
    assert stuck == [1]
    assert lines[0].startswith(
        "  rank 0 (pid 10, physical GPU 2, last completed iteration 6) waits in the collective all_gather"
    )
    assert lines[0].endswith("; NCCL Flight Recorder: nccl:all_gather #7 (process group 0) started")
    facts = "(pid 11, physical GPU 3, last completed iteration 6)"
    assert lines[1] == f"  rank 1 {facts} is in /home/me/project/data.py:35 in __getitem__"


def test_on_nccl_the_flight_recorder_tells_a_waiting_rank():
    """A rank past the collective's call (in a CUDA synchronisation) whose recorder has a collective pending."""
    synchronising = dump((f"{OURS}/train/step/guard.py", 55, "gather_checks"), *BOTTOM)
    pending = {0: "nccl:all_gather #7 (process group 0) started, not completed"}
    assert summary({0: synchronising, 1: IN_LOADER}, {}, pending)[0] == [1]
    assert summary({0: synchronising, 1: IN_LOADER}, {}, {})[0] == [0, 1]


def test_ranks_waiting_in_different_collectives_are_said_not_to_match():
    # Issue #50: the first step of FSDP in parts over uneven shares, before the fix (rank 0 gathers, rank 1 scatters).
    scatter = dump(
        (f"{TORCH}/distributed/distributed_c10d.py", 5916, "reduce_scatter_single"),
        (f"{OURS}/train/step/micro_step.py", 181, "_parts"),
        *BOTTOM,
    )
    stuck, lines = summary({0: IN_GATHER, 1: scatter, 2: scatter}, {}, {})
    assert stuck == [0, 1, 2] and len(lines) == 4
    assert lines[3].startswith("  the ranks wait in different collectives (all_gather, reduce_scatter_single)")
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in lines[3]
    assert len(summary({0: IN_GATHER, 1: IN_GATHER}, {}, {})[1]) == 2  # the same collective: no such line
    assert len(summary({0: IN_GATHER, 1: IN_LOADER}, {}, {})[1]) == 2  # one rank is elsewhere: it is the cause


def test_a_hang_found_by_the_watch_is_the_cause_a_timeouts_lines_follow_it(tmp_path: Path):
    hang = Hang(
        [1],
        ["  rank 1 (pid 11) is in data.py:35 in __getitem__"],
        tmp_path / "hang_x.txt",
        hang_cause(Silence(64, 60, 0.4, {})),
    )
    killed = Outcome(FAILED, "rank 0 terminated with signal SIGKILL", rank=0)
    found = with_hang(killed, hang, stopped=False)
    assert found.cause.startswith(
        "the job hung: no rank made progress for 64 s, longer than the hang watch's window of 60 s"
    )
    assert found.failed == "rank(s) 1" and found.rank is None
    assert found.details.endswith(f"is in data.py:35 in __getitem__\nEvery rank's stacks: {tmp_path / 'hang_x.txt'}")
    timeout = Outcome(FAILED, "rank 0 timed out after 5 s (dist.timeout)")
    assert with_hang(timeout, Hang([1], [], hang.path), stopped=False).cause == timeout.cause
    assert "Where each rank was (rank(s) 1 stuck)" in with_hang(timeout, Hang([1], [], hang.path), False).details


def test_report_file_and_flight_recorder_dumps(tmp_path: Path):
    traces = tmp_path / "attempt0"
    traces.mkdir()
    entries = [
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 5, "pg_id": 0, "state": "completed"},
        {"profiling_name": "nccl:all_gather", "collective_seq_id": 6, "pg_id": 0, "state": "started"},
    ]
    (traces / "nccl_trace_rank_1").write_bytes(pickle.dumps({"entries": entries, "version": "2.4"}))
    (traces / "nccl_trace_rank_0").write_bytes(pickle.dumps({"entries": entries[:1], "version": "2.4"}))
    assert hang_report.flight_recorder(traces) == {
        0: "every one of its last 1 collective completed",
        1: "nccl:all_gather #6 (process group 0) started, not completed",
    }
    path = hang_report.write_report(tmp_path / "run", "why", ["  rank 1 ..."], {0: IN_GATHER, 1: IN_LOADER}, traces)
    text = path.read_text()
    assert path.name.startswith("hang_") and text.startswith("why\n  rank 1 ...\n")
    assert "=== rank 0 ===" in text and "=== rank 1 ===" in text and "__getitem__" in text
    assert len(list((tmp_path / "run").glob("nccl_trace_*/nccl_trace_rank_*"))) == 2


def test_flight_recorder_variables_point_into_the_attempts_folder(tmp_path: Path):
    env = hang_report.flight_recorder_env(tmp_path)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/nccl_trace_rank_"
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == f"{tmp_path}/nccl_pipe_rank_"


def test_a_rank_waiting_for_its_loader_worker_names_the_workers_frame():
    waiting = dump((f"{STDLIB}/threading.py", 331, "wait"), (f"{OURS}/train/data/loaders.py", 55, "__iter__"), *BOTTOM)
    worker = dump(("/home/me/project/data.py", 35, "__getitem__"), (f"{TORCH}/utils/data/_utils/worker.py", 1, "loop"))
    found = where(f"{waiting}\n-- data-loader worker, pid 77 --\n{worker}")
    expected = "waits for its data-loader worker (pid 77), which is in /home/me/project/data.py:35 in __getitem__"
    assert hang_report.describe(found) == expected
