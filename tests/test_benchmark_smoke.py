"""benchmarks/bench_overhead.py still runs and still refuses ratios for runs that did different work.

Timings are never asserted here (see benchmarks/README.md): only that the quick run finishes, prints both loops and
passes its bitwise check, and that a weight mismatch withholds the ratio.
Run: python -m pytest tests/test_benchmark_smoke.py -q
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_overhead.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(75)
def test_quick_run_prints_both_loops_and_identical_weights(tmp_path):
    out = tmp_path / "bench.json"
    # --quick takes 10-30 s on 2 CPU cores (two gloo workers, one short round per workload).
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # on timeout, kill the benchmark's group; its workers die with their parent
    )
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"bench_overhead.py --quick did not finish in 60 s\n{stdout}\n{stderr[-3000:]}")
    assert proc.returncode == 0, stdout + stderr
    rows = [line.split("|") for line in stdout.splitlines() if line.startswith("| tiny MLP | 2 |")]
    loops = [row[3].strip() for row in rows[:3]]
    assert loops == ["hand-written", "ignite-mgpu", "ignite Engine (reference; ratio over hand-written)"], stdout
    assert len(rows) == 4 and float(rows[3][3].split()[0]) > 0, stdout  # the CPU-time row
    assert "Bitwise check passed" in stdout, stdout
    summary = json.loads(out.read_text())
    assert summary["refused"] == []
    assert {k: v["identical"] for k, v in summary["per_iteration"].items()} == {"mlp/2": "1/1", "cnn/2": "1/1"}
    assert summary["calls"]["mlp"]["ignite-mgpu"] > summary["calls"]["mlp"]["hand-written"] > 0


def test_bitwise_difference_names_the_tensor():
    bench = load_bench()
    a = {"w": torch.zeros(3), "b": torch.ones(2)}
    assert bench.bitwise_difference(a, {k: v.clone() for k, v in a.items()}) is None
    assert "w differs" in bench.bitwise_difference(a, {"w": torch.tensor([0.0, 0.0, 1e-7]), "b": torch.ones(2)})
    assert "w differs" in bench.bitwise_difference(a, {"w": torch.tensor([0.0, -0.0, 0.0]), "b": torch.ones(2)})
    assert "different keys" in bench.bitwise_difference(a, {"w": torch.zeros(3)})


def test_report_refuses_a_ratio_when_weights_differ():
    bench = load_bench()
    runs = [
        {"workload": "mlp", "round": 0, "hand-written": 1.0, "ignite-mgpu": 1.5, "difference": "0.weight differs"},
        {"workload": "cnn", "round": 0, "hand-written": 2.0, "ignite-mgpu": 2.0, "difference": None},
    ]
    for run in runs:
        run["cpu"] = {"hand-written": 1.0, "ignite-mgpu": 1.0}
    table, summary = bench.report({2: {"runs": runs, "calls": {}}}, None, [0.1, 0.1, 0.1], quick=True)
    mlp_row = next(line for line in table.splitlines() if line.startswith("| tiny MLP | 2 | ignite-mgpu"))
    ratio_cell = mlp_row.split("|")[5].strip()
    assert ratio_cell == "refused: final weights differ in 1/1 runs (0.weight differs)"
    assert summary["refused"] == ["tiny MLP, 2 procs: 0.weight differs"]
    cnn_row = next(line for line in table.splitlines() if line.startswith("| small CNN | 2 | ignite-mgpu"))
    assert cnn_row.split("|")[5].strip() == "1.000"
    cpu_prefixes = ("| tiny MLP | 2 | 1.0", "| small CNN | 2 | 1.0")
    cpu_rows = [line for line in table.splitlines() if line.startswith(cpu_prefixes)]
    assert [row.split("|")[1].strip() for row in cpu_rows] == ["small CNN"]  # no CPU ratio for refused runs either


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
        "ignite-mgpu create_trainer + EpochReport",
    ], proc.stdout
    assert all(float(row[2]) > 0 for row in rows), proc.stdout
