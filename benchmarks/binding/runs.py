"""The runs bench_binding.py compares: ``ignite-mgpu train`` jobs (the default job, the JPEG image-folder job), the
DDP tutorial's loop (tutorial.py), the generated JPEG folder, and overhead sessions with a binding mode.

Every job runs in a fresh process of this checkout (its root first on PYTHONPATH), without OMP_NUM_THREADS or
MKL_NUM_THREADS: out of the box, as a user starts it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TUTORIAL = str(Path(__file__).with_name("tutorial.py"))
AUTO_WORKERS = re.compile(r"data\.num_workers=auto: (\d+) loader worker")


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env | extra


def _run(argv: list[str], log: Path, env: dict[str, str]) -> str:
    with log.open("w") as f:
        code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    text = log.read_text()
    if code:
        sys.exit(f"benchmark run failed (exit {code}): {' '.join(argv)}\n{text[-4000:]}")
    return text


def train_job(out: Path, args: list[str]) -> dict[str, Any]:
    """``ignite-mgpu train ARGS --output-dir OUT``: samples/s over all epochs (training time only, as the epoch
    report counts it), the last epoch's validation accuracy and data wait, what auto chose, the final weights."""
    argv = [sys.executable, "-m", "ignite_mgpu", "train", *args, "--output-dir", str(out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    text = _run(argv, out.with_suffix(".log"), job_env())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(r["epoch_time_s"] for r in rows)
    samples = sum(r["samples_per_s"] * r["epoch_time_s"] for r in rows)
    workers = AUTO_WORKERS.search(text)
    saved = sorted(out.glob("checkpoint_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return {
        "samples_per_s": samples / seconds,
        "val_accuracy": rows[-1]["val_accuracy"],
        "data_wait_share": rows[-1]["data_wait_share"],
        "binding": next((ln.split(": ", 1)[1] for ln in text.splitlines() if "ignite-mgpu: cpu binding:" in ln), ""),
        "auto_workers": int(workers[1]) if workers else None,
        "weights": str(saved[-1]) if saved else None,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tutorial_job(out: Path, nproc: int, epochs: int, train_size: int) -> dict[str, Any]:
    """tutorial.py: the same job as the DDP tutorial writes it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, TUTORIAL, str(out), f"--nproc={nproc}", f"--epochs={epochs}", f"--train-size={train_size}"]
    _run(argv, out.with_suffix(".log"), job_env(MASTER_PORT=str(_free_port())))
    return json.loads(out.read_text())


def same_weights(a: str, b: str) -> str | None:
    """None when the two files' model weights are bit-identical, else what differs."""
    import torch

    from benchmarks.overhead.loops import bitwise_difference
    from ignite_mgpu.checkpoint.files import read_checkpoint

    def model(path: str) -> dict[str, Any]:
        state = read_checkpoint(path) if Path(path).name.startswith("checkpoint_") else torch.load(path)
        return state.get("model", state)

    return bitwise_difference(model(a), model(b))


def make_jpegs(root: Path, train: int, val: int, size: int = 96, classes: int = 10) -> Path:
    """An ImageNet-layout folder of real JPEG files (root/{train,val}/<class>/*.jpg): per class a colour and a
    stripe frequency, plus noise, so that ResNet-18 can learn it and PIL must decode every file."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 2 * np.pi, size)
    for split, n in (("train", train), ("val", val)):
        for i in range(n):
            c = i % classes
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = np.array([(37 * c) % 256, (91 * c + 40) % 256, (173 * c + 80) % 256], dtype=np.float32)
            stripes = 60 * np.sin((c + 1) * ramp)[None, :, None]
            noise = rng.normal(0, 40, (size, size, 3))
            pixels = np.clip(colour + stripes + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)
    return root


def overhead_session(tmp: Path, variant: str, iters: dict[str, int], epochs: int) -> dict[str, Any]:
    """One session of overhead/bench_overhead.py (the three loops taking turns) on 2 processes: ``none``
    (unpinned), ``cores`` (ignite-mgpu's binding: the training thread on the rank's share, gloo's threads on the
    job's CPUs) or ``pinned`` (bench_overhead.py's own: each rank's training thread on a core, pinned after the group
    started)."""
    from benchmarks.overhead.session import run_session

    binding = "cores" if variant == "cores" else "none"
    return run_session(tmp, 2, ["mlp", "cnn"], 1, iters, epochs, [], variant == "pinned", binding)


def shuffled(names: list[str], round_: int) -> list[str]:
    """The order of the runs in round ``round_``: rotated, and reversed every other round (interleaved)."""
    k = round_ % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if round_ % 2 else order
