"""What a change of size costs against a plain restart (issue #40): from a rank's death to the first iteration of
the restarted group, when its GPU stays (a plain restart on the same 4 processes) and when its GPU is gone (the
failed GPU left out, the restart on 3); and lending: from a job's start in line (``claimer.py --gpus auto:2 --wait``)
to its claim of the lent GPUs, and to the first iteration of the elastic job on the 2 it kept (the stop at the next
check, the stop's checkpoint and the restart). In one run, alternating, with the ratios of the medians.

Runs the real CLI on the 4-GPU stand-in nvidia-smi (tests/fake_gpus) through tests/distributed/fake_cuda_cli.py,
``--gpus auto:2-4 --max-restarts 1``, the workers on gloo on the CPU with the fault model of tests/faults/faultmod.py
(``once-kill`` or ``once-losegpu`` of rank 2, after a checkpoint). Also prints the goodput's own count of each
(``time_restart_s`` / ``time_resize_s`` in metrics.jsonl).
Run: `python benchmarks/restart/bench_resize.py [--repeat 3]` (about 30 s per job on 2 cores); `--quick`: the
script's check, one job per row, two at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ROOT / "tests" / "faults"
STAND_IN = ROOT / "tests" / "fake_gpus"
RUNNER = ROOT / "tests" / "distributed" / "fake_cuda_cli.py"
CLAIMER = ROOT / "tests" / "gpus" / "claimer.py"
JOB = [
    "train",
    "--backend",
    "gloo",
    "--gpus",
    "auto:2-4",
    "--max-restarts",
    "1",
    "model.name=faultmod:make",
    "data.train_size=1280",  # 20 iterations of a global batch of 64
    "data.val_size=100",
    "data.batch_size=64",
    "train.epochs=1",
    "train.progress_bar=false",
    "checkpoint.every_iters=5",
]
FAULT_AT = 13  # rank 2's 13th training step: after checkpoint_10
# Every step sleeps this long (faultmod's slow fault), in every job alike: the lending job is still training when its
# waiter's GPUs are lent (its look comes every 0.5 s, then the next check).
STEP = "slow:*:1:0.1"
UUID = "GPU-a1000000-0000-4000-8000-00000000000{}".format
TABLE = "".join(
    f"{i}, 00000000:{bus}:00.0, NVIDIA A100-SXM4-80GB, 1, 81920, 0, Disabled, {UUID(i)}\n"
    for i, bus in enumerate(["07", "0F", "47", "4E"])
)


def lines(folder: Path, name: str) -> list[list[str]]:
    path = folder / name
    return [ln.split() for ln in path.read_text().splitlines()] if path.is_file() else []


def environment(tmp: str, fault: str) -> dict[str, str]:
    answers = Path(tmp, "answers")
    answers.mkdir()
    (answers / "gpus.csv").write_text(TABLE)
    (answers / "apps.csv").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(
        PATH=f"{STAND_IN}{os.pathsep}{env.get('PATH', '')}",
        FAKE_NVIDIA_SMI_DIR=str(answers),
        IGNITE_MGPU_CLAIMS_DIR=str(Path(tmp, "claims")),
        PYTHONPATH=f"{FAULTS}{os.pathsep}{ROOT}",
        PIDS_DIR=str(Path(tmp, "pids")),
        FAULT=fault,
        OMP_NUM_THREADS="1",
        TMPDIR=tmp,
    )
    return env


def restarted_first_iteration(pids_dir: Path) -> float:
    """When the restarted group finished its first iteration: a restarted rank then starts its second step."""
    first = {lines(pids_dir, f"rank{r}")[0][0] for r in range(4)}
    return min(
        float(t)
        for r in range(4)
        for pid, call, t in lines(pids_dir, f"forward{r}")
        if pid not in first and call == "2"
    )


def measure(kind: str) -> dict[str, float]:
    """One job whose rank 2 dies in its FAULT_AT-th step: ``kill`` (its GPU stays) or ``losegpu`` (it is gone)."""
    with tempfile.TemporaryDirectory(prefix="bench-resize-") as tmp:
        env, out = environment(tmp, f"once-{kind}:2:{FAULT_AT},{STEP}"), Path(tmp, "out")
        proc = subprocess.run(
            [sys.executable, str(RUNNER), *JOB, "--output-dir", str(out)],
            env=env,
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise SystemExit(f"the {kind} job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        pids_dir = Path(env["PIDS_DIR"])
        fault = float(lines(pids_dir, "fault2")[0][1])
        epoch = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        return {
            "first_iteration_s": restarted_first_iteration(pids_dir) - fault,
            "goodput_s": epoch["time_resize_s"] + epoch["time_restart_s"],
            "processes": epoch["processes"],
        }


def measure_lend() -> dict[str, float]:
    """One job on auto:2-4 that a job waiting for 2 GPUs joins the line of once checkpoint_5 is written."""
    with tempfile.TemporaryDirectory(prefix="bench-resize-") as tmp:
        env, out = environment(tmp, STEP), Path(tmp, "out")
        command = [sys.executable, str(RUNNER), *JOB, "--output-dir", str(out)]
        job = subprocess.Popen(command, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while not (out / "checkpoint_5.pt").exists() and job.poll() is None:
            time.sleep(0.01)
        asked = time.time()
        waiter = subprocess.Popen(
            [sys.executable, str(CLAIMER), "--gpus", "auto:2", "--wait", "300", "--hold", "--poll", "0.05"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert waiter.stdout is not None and waiter.stdin is not None
        claimed = json.loads(waiter.stdout.readline())
        _, stderr = job.communicate(timeout=300)
        waiter.stdin.close()
        waiter.wait(30)
        if job.returncode != 0 or "gpus" not in claimed:
            raise SystemExit(f"the lending job failed (exit {job.returncode}, waiter {claimed}):\n{stderr[-3000:]}")
        epoch = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        return {
            "waiter_s": claimed["at"] - asked,
            "first_iteration_s": restarted_first_iteration(Path(env["PIDS_DIR"])) - asked,
            "goodput_s": epoch["time_resize_s"],
            "processes": epoch["processes"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one job per row, two at a time: checks, not timings")
    opts = parser.parse_args()
    repeat = 1 if opts.quick else opts.repeat
    print(f"load average {os.getloadavg()[0]:.2f}; {repeat} job(s) per row, alternating")
    results: dict[str, list[dict[str, float]]] = {"kill": [], "losegpu": [], "lend": []}
    # --quick checks that the script runs and prints every row: its jobs (each in a folder, with GPUs and claims of its
    # own) run two at a time, which makes the figures meaningless; a measuring run takes one job at a time.
    with ThreadPoolExecutor(2 if opts.quick else 1) as pool:
        for _ in range(repeat):
            done = pool.map(lambda kind: measure_lend() if kind == "lend" else measure(kind), list(results))
            for kind, result in zip(list(results), done, strict=True):
                results[kind].append(result)
    medians = {}
    for kind, name in (("kill", "plain restart (GPU stays, 4 -> 4)"), ("losegpu", "change of size (GPU gone, 4 -> 3)")):
        first = [r["first_iteration_s"] for r in results[kind]]
        counted = [r["goodput_s"] for r in results[kind]]
        medians[kind] = statistics.median(first)
        after = sorted({int(r["processes"]) for r in results[kind]})
        print(
            f"{name:36s}: death -> first iteration of the restarted group: median {medians[kind]:.2f} s "
            f"(min {min(first):.2f}, max {max(first):.2f}); goodput's restart/resize part: median "
            f"{statistics.median(counted):.2f} s; processes after: {after}",
            flush=True,
        )
    lend = results["lend"]
    waiter, medians["lend"] = (statistics.median(r[k] for r in lend) for k in ("waiter_s", "first_iteration_s"))
    print(
        f"{'lending (4 -> 2, a job waits for 2)':36s}: in line -> the waiter has its GPUs: median {waiter:.2f} s; -> "
        f"first iteration on 2: median {medians['lend']:.2f} s (max {max(r['first_iteration_s'] for r in lend):.2f}); "
        f"goodput's resize part: median {statistics.median(r['goodput_s'] for r in lend):.2f} s; processes after: "
        f"{sorted({int(r['processes']) for r in lend})}",
        flush=True,
    )
    print(f"change of size / plain restart: {medians['losegpu'] / medians['kill']:.2f}")
    print(f"lending (waiter in line -> first iteration on 2) / plain restart: {medians['lend'] / medians['kill']:.2f}")


if __name__ == "__main__":
    main()
