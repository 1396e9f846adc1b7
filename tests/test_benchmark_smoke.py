"""Every benchmark still runs: benchmarks/overhead/bench_overhead.py still refuses ratios for runs that did different
work, binding/bench_binding.py still runs all its parts, and the others print their tables.

Timings are never asserted here (see benchmarks/README.md): only that the quick runs finish, print every loop and
pass their bitwise checks, and that a weight mismatch withholds the ratio. The helpers are imported as
``benchmarks.<folder>.<module>`` (pytest puts the repository root on sys.path), the scripts run by path.
Run: python -m pytest tests/test_benchmark_smoke.py -q
"""

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.overhead import loops, report, session
from tests.conftest import run_in_session
from tests.helpers import cpu_fsdp

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "overhead" / "bench_overhead.py"


def run_quick(script, json_out, timeout):
    """``python SCRIPT --quick --json OUT`` in its own session (killed with its workers past ``timeout``): stdout."""
    result = run_in_session([sys.executable, str(script), "--quick", "--json", str(json_out)], timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(75)
def test_quick_run_prints_both_loops_and_identical_weights(tmp_path):
    out = tmp_path / "bench.json"
    # --quick takes 10-30 s on 2 CPU cores (two gloo workers, one short round per workload).
    stdout = run_quick(SCRIPT, out, timeout=60)
    mlp = [line.split("|") for line in stdout.splitlines() if line.startswith("| tiny MLP | 2 |")]
    names = ["hand-written", "ignite-mgpu", "ignite Engine (reference)"]
    rows, over_engine = [row for row in mlp if row[3].strip() in names], [r for r in mlp if r[3].strip() not in names]
    assert [row[3].strip() for row in rows] == names * 2, stdout  # time, CPU time
    assert all(float(row[4].split()[0]) > 0 for row in rows), stdout
    assert len(over_engine) == 1 and float(over_engine[0][3].split()[0]) > 0, stdout  # ignite-mgpu / bare Engine
    assert over_engine[0][5].strip() == "≤ 1.01", stdout  # the per-iteration target: over the bare Engine
    assert "Bitwise check passed" in stdout, stdout
    summary = json.loads(out.read_text())
    assert summary["refused"] == []
    assert {k: v["identical"] for k, v in summary["per_iteration"].items()} == {"mlp/2": "1/1", "cnn/2": "1/1"}
    assert summary["calls"]["mlp"]["ignite-mgpu"] > summary["calls"]["mlp"]["hand-written"] > 0


def test_bitwise_difference_names_the_tensor():
    a = {"w": torch.zeros(3), "b": torch.ones(2)}
    assert loops.bitwise_difference(a, {k: v.clone() for k, v in a.items()}) is None
    assert "w differs" in loops.bitwise_difference(a, {"w": torch.tensor([0.0, 0.0, 1e-7]), "b": torch.ones(2)})
    assert "w differs" in loops.bitwise_difference(a, {"w": torch.tensor([0.0, -0.0, 0.0]), "b": torch.ones(2)})
    assert "different keys" in loops.bitwise_difference(a, {"w": torch.zeros(3)})


def record(workload, difference, times):
    """A round as session_worker records it: turns of 2 iterations, (wall s, CPU s) per turn and loop."""
    turns = {name: [(t, t / 2) for t in values] for name, values in times.items()}
    return {"workload": workload, "round": 0, "window": 2, "difference": difference, "turns": turns}


def test_report_refuses_a_ratio_when_weights_differ():
    runs = [
        record("mlp", "0.weight differs", {"hand-written": [1.0, 1.0], "ignite-mgpu": [1.5, 1.5]}),
        record("cnn", None, {"hand-written": [2.0, 4.0], "ignite-mgpu": [2.0, 4.0], "ignite Engine": [1.0, 3.0]}),
    ]
    table, summary = report.report({2: {"runs": runs, "calls": {}}}, None, [0.1, 0.1, 0.1], quick=True)
    sections = table.split("\n\n")[:3]  # ms / iteration, CPU time, over the bare Engine
    timed, cpu, over = ([line.split("|") for line in part.splitlines()[2:]] for part in sections)
    rows = {tuple(c.strip() for c in row[1:4]): row for row in timed}
    mlp_row = rows["tiny MLP", "2", "ignite-mgpu"]
    assert mlp_row[5].strip() == "refused: final weights differ in 1/1 runs (0.weight differs)"
    assert summary["refused"] == ["tiny MLP, 2 procs: 0.weight differs"]
    cnn_row = rows["small CNN", "2", "ignite-mgpu"]
    assert cnn_row[5].strip() == "1.000 [1.000–1.000]" and len(cnn_row) == 8  # the reference: no target here
    assert summary["per_iteration"]["cnn/2"]["loops"]["ignite-mgpu"]["ms_per_round"] == [1500.0]  # 6 s / 4 iterations
    cpu_rows = [row for row in cpu if "CNN" in row[1]]
    assert [row[3].strip() for row in cpu_rows] == ["hand-written", "ignite-mgpu", "ignite Engine (reference)"]
    over_engine = [row for row in over if "CNN" in row[1]]
    assert [row[3].strip() for row in over_engine] == ["1.500 [1.333–2.000]"]  # 6 s / 4 s over both turns
    assert [c.strip() for c in over_engine[0][5:7]] == ["≤ 1.01", "**no**"]  # the whole interval lies above it
    assert summary["per_iteration"]["cnn/2"]["met"] == "**no**"
    assert summary["per_iteration"]["cnn/2"]["over_reference"]["extra_cpu_s"] == 0.25  # CPU is half the wall
    assert "mlp/2" not in [k for k, v in summary["per_iteration"].items() if "over_reference" in v]  # refused
    assert cpu_rows[1][5].strip() == "0 [0–0]"  # the CPU clock ran half the wall time in both loops
    refused_cpu = [row for row in table.splitlines() if row.count("|") == 6 and row.startswith("| tiny MLP | 2 | ig")]
    assert [row.split("|")[5].strip() for row in refused_cpu] == [""]  # no CPU difference for refused runs either


def test_verdict_needs_the_whole_interval_on_one_side():
    assert report.verdict(1.01, 1.02, 0.0, 1.03) == "yes"
    assert report.verdict(1.04, 1.06, 0.0, 1.03) == "**no**"
    assert report.verdict(1.02, 1.04, 0.0, 1.03).startswith("undecided")
    assert report.verdict(0.99, 1.01, 0.98, 1.02) == "yes"  # the scaling target is a band


def test_loops_take_turns_and_end_with_the_same_weights():
    """(a) and the bare-Engine reference, paused every 3 iterations, reach the weights of uninterrupted (a)."""
    cfg = loops.make_config("mlp", 6, 2, "unused", 1)
    straight = loops.finish(loops.hand_steps(loops.hand_built(cfg), 2, None))
    hand, engine = (steps(loops.hand_built(cfg), 2, 3) for steps in (loops.hand_steps, loops.engine_steps))
    for _ in range(4):  # 12 iterations: 4 turns each
        next(hand)
        next(engine)
    assert loops.bitwise_difference(straight, loops.finish(hand)) is None
    assert loops.bitwise_difference(straight, loops.finish(engine)) is None
    assert session.window_size(500) == 100 and session.window_size(7) == 1 and session.window_size(40) == 8


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_engine_floor_prints_all_four_loops():
    script = SCRIPT.with_name("bench_engine_floor.py")
    proc = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "--iters", "50"], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ") and "µs" not in line]
    assert [row[1].strip() for row in rows] == [
        "plain loop",
        "ignite Engine, same step",
        "ignite-mgpu create_trainer",
        "ignite-mgpu create_trainer + EpochLog",
    ], proc.stdout
    assert all(float(row[2]) > 0 for row in rows), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cpu_allocator_benchmark_prints_both_modes():
    script = BENCHMARKS / "allocator" / "bench_cpu_allocator.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "--steps", "2", "--batch", "8"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| 8 |")]
    assert [row[2].strip() for row in rows] == ["glibc default", "keep_freed_memory"], proc.stdout
    assert all(float(row[3].split()[0]) > 0 for row in rows), proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_binding_quick_run_prints_every_part(tmp_path):
    """bench_binding.py --quick (about a minute on 2 CPU cores): every row of its three parts, and the checks."""
    out = tmp_path / "binding.json"
    stdout = run_quick(BENCHMARKS / "binding" / "bench_binding.py", out, timeout=180)
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines() if line.startswith("| ")]
    jobs = [row[0] for row in cells if row[0].startswith(("ignite-mgpu --cpu-binding", "DDP tutorial", "auto / none"))]
    assert jobs[0] == "ignite-mgpu --cpu-binding auto" and jobs[2].startswith("DDP tutorial loop"), stdout
    assert jobs[1] == "ignite-mgpu --cpu-binding none (the default as shipped)" and jobs[3] == "auto / none", stdout
    per_loop = [
        row[:3] for row in cells if len(row) == 5 and row[2] in ("hand-written", "ignite Engine", "ignite-mgpu")
    ]
    assert len(per_loop) == 12, stdout  # 2 workloads x 3 loops x (unpinned, cores)
    over_engine = [row for row in cells if len(row) == 6 and row[3] == "≤ 1.01"]
    assert [row[:2] for row in over_engine] == [[w, b] for w in ("tiny MLP", "small CNN") for b in ("none", "cores")]
    assert all(len(row[5].split()) == 2 for row in over_engine), stdout  # extra CPU µs and its interval
    assert (
        "Final weights bit-identical over every loop and binding (1 thread each): tiny MLP: yes, small CNN: yes."
        in (stdout)
    )
    assert [row[0] for row in cells if row[0].startswith("data.num_workers=")] == [
        "data.num_workers=0",
        "data.num_workers=auto",
    ], stdout
    summary = json.loads(out.read_text())
    assert summary["job"]["auto_vs_none_identical"] in ("1/1", "not compared")  # 1/1 whenever the threads match
    if summary["job"]["threads"]["auto"] == summary["job"]["threads"]["none"]:
        assert summary["job"]["auto_vs_none_identical"] == "1/1", stdout
    assert all(summary["overhead"]["identical"].values())
    assert isinstance(summary["jpeg"]["runs"]["auto"][0]["auto_workers"], int)


@pytest.mark.slow
@pytest.mark.distributed
@cpu_fsdp
@pytest.mark.timeout(150)
def test_fsdp_memory_quick_run_prints_the_table(tmp_path):
    """bench_fsdp_memory.py --quick: 4 short CLI jobs (DDP and FSDP on 1 and 2 processes) and the table."""
    script = BENCHMARKS / "fsdp" / "bench_fsdp_memory.py"
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True, text=True, timeout=140
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| ddp |", "| fsdp |"))]
    assert [r.split("|")[1:3] for r in rows] == [
        [" ddp ", " 1 "],
        [" fsdp ", " 1 "],
        [" ddp ", " 2 "],
        [" fsdp ", " 2 "],
    ]
    assert "FSDP / DDP on 2 processes, largest rank:" in proc.stdout
    assert [len(r["peak_memory_mb"]) for r in json.loads(out.read_text())["rows"]] == [1, 1, 2, 2]


@pytest.fixture
def instructions(monkeypatch):
    """bench_instructions.py imported in this process (the thread variables it sets on import restored after)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")  # the values the script sets: monkeypatch then restores the test's own
    return importlib.import_module("benchmarks.instructions.bench_instructions")


@pytest.mark.timeout(120)
def test_instruction_loops_run_natively_and_end_with_the_same_weights(instructions, tmp_path):
    """The three loops of bench_instructions.py (its --quick plan, one process, outside valgrind, where the toggles
    do nothing) run and end bit-identical: a ratio of their counts compares the same work. ``--set`` reaches
    ignite-mgpu's job (here its checkpoint written in the step)."""
    overrides = ["checkpoint.async_save=false"]
    spec = {"dir": str(tmp_path), "nproc": 1, "workloads": ["mlp"], "plan": instructions.QUICK, "overrides": overrides}
    instructions.inside(spec)
    assert json.loads((tmp_path / "differences.json").read_text()) == {"mlp": []}
    assert (tmp_path / "rank0.pid").read_text().strip().isdigit()
    assert "async_save: false" in (tmp_path / "mlp-ignite-mgpu" / "config.yaml").read_text()


def test_instruction_counts_are_read_per_rank_and_refused_for_other_weights(instructions, tmp_path):
    spec = {"dir": str(tmp_path), "nproc": 2, "workloads": ["mlp"], "plan": {"mlp": [1, 10, 10]}}
    for rank, pid in enumerate((101, 202)):
        (tmp_path / f"rank{rank}.pid").write_text(f"{pid}\n")
        (tmp_path / f"callgrind.out.{pid}").write_text("events: Ir\nsummary: 0\ntotals: 0\n")  # the dump at exit
        for part, total in enumerate((22_000_000, 22_500_000, 22_600_000 + rank * 200_000), start=1):
            # As callgrind writes them: a header with the summary, ... , the totals at the end.
            (tmp_path / f"callgrind.out.{pid}.{part}").write_text(
                f"events: Ir\nsummary: {total}\nfn=x\ntotals: {total}\n"
            )
    result = instructions.parse_dumps(tmp_path, spec)
    assert result["rank 0"]["mlp"] == {"hand-written": 2.2e6, "ignite Engine": 2.25e6, "ignite-mgpu": 2.26e6}
    rows = [
        line.split("|")
        for line in instructions.report(result, spec["plan"], 2, {"mlp": []})
        if line.startswith("| tiny")
    ]
    assert [(r[2].strip(), r[8].strip(), r[9].strip()) for r in rows] == [
        ("0", "1.0044", "met"),
        ("1", "1.0133", "**not met**"),
    ]
    refused = instructions.report(result, spec["plan"], 2, {"mlp": ["0.weight differs"]})
    assert "| tiny MLP | 0 | refused: 0.weight differs |" in refused and "tiny MLP: **no**." in refused[-1]
    (tmp_path / "callgrind.out.202.3").unlink()  # a rank that dumped fewer windows than it ran: no figure at all
    with pytest.raises(SystemExit, match="rank 1: callgrind wrote 2 window dumps, expected 3"):
        instructions.parse_dumps(tmp_path, spec)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fsdp_step_benchmark_evaluation_loops_compute_the_same_metrics(tmp_path):
    """bench_fsdp_step.py's evaluation loops on one process (no all-reduce): ignite-mgpu's evaluator and the
    hand-written no_grad loop report equal loss and accuracy, pass after pass; a mismatch withholds the ratio."""
    from benchmarks.fsdp import eval_loops, step_report

    cfg = eval_loops.make_config("cnn", 128, tmp_path, 1)
    cfg.train.keep_cpu_memory = False  # built() sets the allocator up as the job does: not in the test process
    times, differences = eval_loops.evaluation_turns(eval_loops.built(cfg), passes=2)
    assert differences == [] and [len(t) for t in times.values()] == [2, 2, 2]  # hand-written, ignite-mgpu, bare Engine
    assert eval_loops.difference({"hand-written": {"loss": 1.0}, "ignite-mgpu": {"loss": 1.5}}) is not None
    record = {"turns": times, "window": 2, "differences": ["pass 0: hand-written {...}"]}
    summary = {"refused": [], "eval": {}}
    (row,) = step_report.eval_rows({"cnn": record}, summary)[3:]
    assert "refused: metrics differ" in row and summary["refused"] and "ratio" not in summary["eval"]["cnn"]


def test_fsdp_step_instruction_counts_are_read_per_part_and_rank(tmp_path):
    """bench_fsdp_step.py --instructions: each rank's numbered dumps are read as (part, loop) windows in run order,
    counted per iteration or per batch; a failed check withholds that part's ratio."""
    from benchmarks.fsdp import step_instructions as si

    windows = [("step", loop, 8.0) for loop in si.LOOPS] + [("cnn", loop, 8.0) for loop in si.LOOPS]
    for rank, pid in enumerate((101, 202)):
        (tmp_path / f"rank{rank}.pid").write_text(f"{pid}\n")
        for n, total in enumerate((80_000_000, 80_800_000, 8_000_000, 8_400_000), start=1):
            (tmp_path / f"callgrind.out.{pid}.{n}").write_text(f"events: Ir\nsummary: {total}\ntotals: {total}\n")
    result = si.counts(tmp_path, windows)
    assert result["step"]["rank 1"] == {"hand-written": 1e7, "ignite-mgpu": 1.01e7}
    checks = {"step": None, "eval": {"cnn": {"batches": 4, "difference": "loss differs"}}}
    rows = [line.split("|") for line in si.table(result, checks, (4, 8), 2) if line.startswith("| ")][1:]
    assert [(r[2].strip(), r[7].strip(), r[8].strip()) for r in rows[:2]] == [(rank, "1.0100", "met") for rank in "01"]
    assert all("refused: loss differs" in r[4] for r in rows[2:]) and len(rows) == 4


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_checkpoint_stall_quick_run_prints_both_formats(tmp_path):
    """bench_checkpoint_stall.py --quick: a small model, full format in-process, sharded on 2 gloo processes."""
    script = BENCHMARKS / "checkpoint" / "bench_checkpoint_stall.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=140
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for name in ("full", "sharded"):
        assert f"{name}: async / sync stall ratio" in proc.stdout, proc.stdout
    assert list(tmp_path.iterdir()) == []  # the checkpoints were deleted


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_resize_benchmark_prints_both_restarts_lending_and_their_ratios():
    """bench_resize.py --quick (one job per row, two at a time): a plain restart on 4, a change of size to 3 and a
    lending to 2, on the stand-in nvidia-smi."""
    script = BENCHMARKS / "restart" / "bench_resize.py"
    proc = run_in_session([sys.executable, str(script), "--quick"], 190)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for after in ("[4]", "[3]", "[2]"):
        assert f"processes after: {after}" in proc.stdout, proc.stdout
    assert float(proc.stdout.split("change of size / plain restart: ")[1].split()[0]) > 0, proc.stdout
    assert float(proc.stdout.split("first iteration on 2) / plain restart: ")[1].split()[0]) > 0, proc.stdout


def test_not_training_takes_each_figure_from_the_run_that_measured_it(monkeypatch):
    """bench_not_training runs the FSDP benchmark twice (the step and the CNN's evaluation, then the tiny GPT-2's
    evaluation with more passes): one table gets the step from the first, each evaluation from its own run."""
    bench = importlib.import_module("benchmarks.not_training.bench_not_training")
    outputs = [
        {"step": {"ratio": 0.998, "met": "met"}, "eval": {"cnn": {"ratio": 1.007, "met": "met"}}},
        {"step": None, "eval": {"gpt2": {"ratio": 1.019, "met": "undecided"}}},
    ]
    calls = []

    def fake_run(name, argv, log):
        calls.append(argv[1:-2])
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(outputs[len(calls) - 1]))
        return ""

    monkeypatch.setattr(bench, "run", fake_run)
    rows = bench.fsdp(False, [])
    assert calls == bench.LONG_FSDP
    assert [(row.value, row.verdict) for row in rows] == [(0.998, "met"), (1.007, "met"), (1.019, "undecided")]
    assert "(tiny GPT-2)" in rows[0].what and "(cnn)" in rows[1].what and "(gpt2)" in rows[2].what


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_one_gpu_check_lists_its_checks_and_its_cpu_dry_run_passes():
    # benchmarks/gpu_check_one.py (issue #44): its checks on gloo where they can run without CUDA, so that the
    # script a lent GPU runs once is known to work up to the device.
    script = BENCHMARKS / "gpu_check_one.py"
    listed = subprocess.run([sys.executable, str(script), "--list"], capture_output=True, text=True, timeout=30)
    from tests.gpu.test_one_gpu import CHECKS

    assert [line.split(":")[0] for line in listed.stdout.splitlines()] == CHECKS
    dry = ["nccl_ddp", "fsdp_offload", "dcp_sharded", "deterministic_resume"]
    proc = subprocess.run(
        [sys.executable, str(script), "--cpu", "--only", *dry], capture_output=True, text=True, timeout=220
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [["PASS", name] for name in dry], proc.stdout


@pytest.mark.timeout(120)
def test_the_startup_tracer_times_every_event_of_a_ddp_step_in_order(tmp_path):
    """bench_startup.py's tracer (benchmarks/overhead/trace) in a one-process DDP step, read by its time line."""
    bench = importlib.import_module("benchmarks.overhead.bench_startup")
    script = (
        "import torch, torch.distributed as dist\n"
        "from torch.utils.data import DataLoader\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/rendezvous', rank=0, world_size=1)\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x in DataLoader(torch.randn(8, 3), batch_size=4):\n"
        "    model(x).sum().backward()\n"
        "    optimizer.step()\n"
        "dist.destroy_process_group()\n"
    )
    trace = tmp_path / "trace.txt"
    env = {**os.environ, "PYTHONPATH": bench.TRACE_DIR, "BENCH_STARTUP_TRACE": str(trace)}
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = bench.timeline(trace, start, launcher=int(trace.read_text().split()[1]))  # one process: rank 0
    # Every event once, in the order it happens (DDP's constructor imports torch._dynamo; no fork, no ignite).
    events = ["interpreter", "torch", "process group", "torch._dynamo", "model wrapped", "loop", "first backward"]
    assert [f"rank 0 {e}" for e in [*events, "first step"]] == list(found), found
    assert 0 < found["rank 0 interpreter"] < found["rank 0 torch"] < found["rank 0 first step"] < 100


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_step_split_benchmark_prints_its_row():
    """bench_step_split.py --quick: one size on 2 gloo processes, its split held against the unsynced step."""
    script = BENCHMARKS / "step_split" / "bench_step_split.py"
    result = run_in_session([sys.executable, str(script), "--quick"], 110)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 19,210 | 16 |")]
    assert len(rows) == 1 and all(float(cell) >= 0 for cell in rows[0].strip("| ").split(" | ")[2:5]), result.stdout
