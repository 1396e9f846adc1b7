"""The worker's stop request, collective timeout and status file (ignite_mgpu/env/stop.py), in this process; and the
source check that every process group the package makes is given the job's timeout (``stop.group_timeout()``):
torch gives a group made without ``timeout=`` its own default (30 minutes on gloo, 10 on NCCL), whatever the job's
group was given. `python -m pytest tests/env/test_stop.py -q`.
"""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import ignite_mgpu
from ignite_mgpu.env import stop

PACKAGE = Path(ignite_mgpu.__file__).parent
# What makes a process group (torch.distributed, ignite's idist.initialize, torch's device meshes).
MAKERS = {
    "init_process_group",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "init_device_mesh",
    "idist.initialize",
}
# Groups that never communicate, each with its reason.
EXEMPT = {
    # `ignite-mgpu plan`: PyTorch's "fake" backend in the launching process, a step on fake tensors.
    ("memory/estimate.py", "init_process_group"),
    ("memory/estimate.py", "init_device_mesh"),
}


def group_calls() -> list[tuple[str, str, ast.Call]]:
    """(module path in the package, maker's name, the call) of every call to a group maker."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                name = "idist.initialize" if ast.unparse(func) == "idist.initialize" else name
                if name in MAKERS:
                    found.append((path.relative_to(PACKAGE).as_posix(), name, node))
    return found


def test_every_group_the_package_makes_passes_the_jobs_timeout():
    calls = group_calls()
    makers = {(path, name) for path, name, _ in calls}
    # The job's group (both ways), FSDP's offload mesh, the micro-batch agreement, the sharded writer.
    assert {
        ("processes/worker.py", "init_process_group"),
        ("processes/worker.py", "idist.initialize"),
        ("parallel/fsdp.py", "new_group"),
        ("train/step/micro_step.py", "new_group"),
        ("checkpoint/sharded.py", "new_group"),
    } <= makers, sorted(makers)
    without = [
        f"{path}:{call.lineno} {name}"
        for path, name, call in calls
        if (path, name) not in EXEMPT
        and not any(k.arg == "timeout" and ast.unparse(k.value) == "stop.group_timeout()" for k in call.keywords)
    ]
    assert not without, f"made without timeout=stop.group_timeout() (torch's default, not dist.timeout): {without}"


def test_group_timeout_is_dist_timeout_or_torchs_default():
    assert stop.group_timeout() is None  # outside a worker: torch's default
    stop.set_collective_timeout(2.5)
    assert stop.group_timeout() == timedelta(seconds=2.5)
    stop.reset()
    assert stop.group_timeout() is None


def test_the_status_file_holds_the_waypoints(tmp_path):
    stop.set_status_file(tmp_path / "status3")
    assert stop.read_status(tmp_path / "status3") == (0, False, 0, 0)
    stop.note_waypoint()
    stop.note_waypoint()
    stop.note_activity()
    assert stop.read_status(tmp_path / "status3") == stop.Status(0, False, 1, 2)
    stop.reset()
