"""launch() and fit() from a notebook, executed by a real Jupyter kernel (nbclient, ipykernel): a function defined
in a cell trains on 2 forked gloo processes and rank 0's return value reaches the cell; a failing rank raises
JobFailed in the cell (not SystemExit); fit returns its result; CUDA touched in the kernel is refused (gpu twin).
And ``python -`` (stdin): the same fork, but a failure exits with the job's code as a script does.
`python -m pytest tests/distributed/test_notebooks.py`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, TINY, needs_gpus, run_in_session

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

DEFINE = """
import os
import torch
import torch.distributed as dist
import ignite.distributed as idist
from ignite_mgpu import launch
from ignite_mgpu.errors import JobFailed

def train(local_rank, steps):
    torch.manual_seed(0)
    model = idist.auto_model(torch.nn.Linear(4, 1))  # DDP over the 2 forked processes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.rand(32, 4, generator=torch.Generator().manual_seed(idist.get_rank()))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizer.step()
    ranks = torch.tensor([idist.get_rank() + 1.0])
    dist.all_reduce(ranks)
    return {"world_size": idist.get_world_size(), "backend": idist.backend(), "sum": ranks.item(),
            "pid": os.getpid(), "weight": model.module.weight.detach()}
"""
LAUNCH = """
result = launch(train, 5, nproc=2)
print("RESULT", result["world_size"], result["backend"], result["sum"], result["pid"] != os.getpid(),
      tuple(result["weight"].shape))
"""
FAIL = """
def broken(local_rank):
    if idist.get_rank() == 1:
        raise ValueError("rank one read a corrupt batch")
    dist.barrier()

try:
    launch(broken, nproc=2)
except JobFailed as err:
    print("CAUGHT", err.exit_code, err.rank, "ValueError: rank one read a corrupt batch" in err.traceback)
launch(broken, nproc=2)
"""
NOTHING_LEFT = """
import psutil
print("CHILDREN", [p.pid for p in psutil.Process().children(recursive=True)])
"""


def execute(cells: list[str], cwd: Path, timeout: float = 150) -> tuple[list, int]:
    """Run the cells in a fresh kernel (errors do not stop it); returns each cell's outputs and the kernel's pid."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os; print('PID', os.getpid())")])
    nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()
    outputs = [cell.outputs for cell in nb.cells]
    pid = int(text(outputs[0]).split()[1])
    return outputs[1:], pid


def text(outputs) -> str:
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")


def error(outputs) -> dict:
    found = [o for o in outputs if o.get("output_type") == "error"]
    return found[0] if found else {}


def assert_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the kernel {pid} outlived its notebook"
        time.sleep(0.1)


@pytest.fixture
def kernel_env(monkeypatch):
    """The kernel's environment: this checkout importable, no outer launcher, one thread per process."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_function_defined_in_a_cell_trains_on_2_processes_and_a_failure_raises_in_the_cell(tmp_path, kernel_env):
    fit_cell = f"""
from ignite_mgpu import fit, load_config
cfg = load_config(None, {[*TINY, "train.epochs=1", "dist.nproc=1", "output_dir=run"]!r})
result = fit(cfg)
print("FIT", result == 0, result.exit_code, result.output_dir, result.metrics["epoch"], result.best_model.name)
"""
    (define, launched, failed, fitted, left), kernel = execute([DEFINE, LAUNCH, FAIL, fit_cell, NOTHING_LEFT], tmp_path)
    assert not error(define), error(define)
    assert text(launched).splitlines()[-1] == "RESULT 2 gloo 3.0 True (1, 4)", launched  # rank 0's value
    assert text(failed).splitlines()[0] == "CAUGHT 1 1 True", failed
    raised = error(failed)
    assert raised["ename"] == "JobFailed" and raised["ename"] != "SystemExit", raised
    assert raised["evalue"].startswith("rank 1 failed with ValueError: rank one read a corrupt batch\nTraceback")
    assert text(failed).count("rank one read a corrupt batch") == 0  # not printed as well: the exception says it
    assert not error(fitted), error(fitted)
    assert text(fitted).splitlines()[-1].startswith("FIT True 0 run 1 best_model_"), fitted
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert text(left).strip() == "CHILDREN []", left  # no worker outlived its job
    assert_gone(kernel)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_from_stdin_the_workers_are_forked_and_a_failure_exits_with_the_jobs_code(tmp_path):
    program = DEFINE + LAUNCH + FAIL.split("try:")[0] + "launch(broken, nproc=2)\nprint('not reached')\n"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    (tmp_path / "program.py").write_text(program)
    shell = f"{sys.executable} - < {tmp_path / 'program.py'}"
    r = run_in_session(["/bin/sh", "-c", shell], 100, cwd=tmp_path, env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "RESULT 2 gloo 3.0 True (1, 4)" in r.stdout and "not reached" not in r.stdout
    assert r.stderr.count("ignite-mgpu: rank 1 failed with ValueError: rank one read a corrupt batch") == 1
    assert "SystemExit" not in r.stderr and "Can't get attribute" not in r.stderr


CUDA_IN_THE_KERNEL = """
x = torch.zeros(1, device="cuda")
try:
    launch(train, 5, nproc=1, max_restarts=1)
except ValueError as err:
    print("REFUSED", type(err).__name__, str(err))
"""
ASKED_IN_THE_KERNEL = """
print("AVAILABLE", torch.cuda.is_available())
try:
    launch(train, 5, nproc=1, max_restarts=1)
except ValueError as err:
    print("REFUSED", type(err).__name__, str(err))
"""


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_a_cell_trains_on_2_gpus_with_nccl_and_gets_rank_0s_tensor_on_the_cpu(tmp_path, kernel_env):
    needs_gpus(2)
    check = "\nprint('DEVICE', result['weight'].device, torch.cuda.is_initialized())\n"
    (define, launched), _ = execute([DEFINE, LAUNCH.replace("nproc=2", "nproc=2, gpus='0,1'") + check], tmp_path)
    assert not error(define) and not error(launched), error(launched)
    assert "RESULT 2 nccl 3.0 True (1, 4)" in text(launched)
    assert "DEVICE cpu False" in text(launched)  # the value was moved to the CPU: the kernel can fork again


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_cuda_initialised_or_asked_in_the_kernel_is_refused_with_what_did_it(tmp_path, kernel_env):
    needs_gpus(1)
    (_, used), _ = execute([DEFINE, CUDA_IN_THE_KERNEL], tmp_path)
    assert "REFUSED ConfigError launch() starts the workers by fork" in text(used), used
    assert "`x` is on cuda:0. Restart the kernel" in text(used)
    (_, asked), _ = execute([DEFINE, ASKED_IN_THE_KERNEL], tmp_path)
    assert "AVAILABLE True" in text(asked) and "a call such as torch.cuda.is_available()" in text(asked), asked
    nvml = 'os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"\n' + ASKED_IN_THE_KERNEL
    ran = "\nprint('RAN', launch(train, 5, nproc=1, max_restarts=1)['sum'])"
    (_, fine), _ = execute([DEFINE, nvml + ran], tmp_path)
    assert "RAN 1.0" in text(fine), fine  # asked through NVML: the fork stays usable


def test_the_jupyter_tool_chain_is_in_the_dev_extra():
    setup = (REPO / "setup.cfg").read_text().split("dev =")[1].split("\n[")[0].split("nvml =")[0]
    for package in ("nbclient", "ipykernel", "nbformat"):
        assert f"    {package}>=" in setup, package
