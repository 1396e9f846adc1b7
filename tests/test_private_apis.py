"""The private names of PyTorch, ignite, numpy and the standard library that ignite-mgpu still uses, where no public
way exists (CONTRIBUTING.md, "Private APIs we still use"): each is checked for the kind, signature or behaviour we
rely on, so that an upgrade that renames or changes one fails here, with the module of ours that uses it and what
to do, rather than deep inside a job. `python -m pytest -q tests/test_private_apis.py`."""

from __future__ import annotations

import argparse
import inspect
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.helpers import memory_trackers

SEE = "See CONTRIBUTING.md, 'Private APIs we still use'."


def changed(name: str, what: str, ours: str, todo: str) -> str:
    """The failure message: which private name changed and how, which module of ours uses it, what to do."""
    return f"{name} {what} in this release (used by {ours}). {todo} {SEE}"


def parameters(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- the memory plan


def test_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert "allow_non_fake_inputs" in parameters(FakeTensorMode.__init__), changed(
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "no longer takes allow_non_fake_inputs",
        "ignite_mgpu/memory/estimate.py (measure)",
        "Find how this release builds a model from real weights under the fake mode, and update measure.",
    )


@memory_trackers
def test_memory_trackers_call_the_peak_method_we_override():
    """``_PeakOnly`` replaces the trackers' ``_update_peak_stats`` (the per-module peaks, ~7x slower): the
    trackers must still call it after each op, with the state they keep under the same names."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from ignite_mgpu.memory import estimate

    where = "ignite_mgpu/memory/estimate.py (_PeakOnly)"
    todo = "Port _PeakOnly to this release's trackers, or drop it if they gained a switch for the per-module peaks."
    for kind in (MemTracker, FSDPMemTracker):
        name = f"{kind.__module__}.{kind.__name__}._update_peak_stats"
        method = getattr(kind, "_update_peak_stats", None)
        assert method is not None and parameters(method) == ["self", "peak_state"], changed(
            name, "is gone or takes other arguments", where, todo
        )
        assert "_update_peak_stats" in inspect.getsource(kind.__torch_dispatch__), changed(
            name, "is no longer called after each op", where, todo
        )
    mem = MemTracker()
    for attr in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap"):
        assert isinstance(getattr(mem, attr, None), dict), changed(f"MemTracker.{attr}", "is gone", where, todo)
    calls = []
    tracker = estimate.StepTracker()

    def counted(state):
        calls.append(state)
        estimate._PeakOnly._update_peak_stats(tracker, state)

    tracker._update_peak_stats = counted
    model = nn.Linear(4, 4)
    with tracker:
        (model(torch.ones(2, 4)) ** 2).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")
    assert calls and peak and next(iter(peak.values()))["Total"] > 0, changed(
        "MemTracker._update_peak_stats", "is not what sets the peak any more", where, todo
    )


# ---------------------------------------------------------------------------------------- the process layer


def test_forkserver_internals():
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    where = "ignite_mgpu/processes/forkserver.py (start, _end, leave_server)"
    todo = "Port start/_end/leave_server to this Python's ForkServer (its pid, alive pipe, socket and lock)."
    assert isinstance(server, forkserver.ForkServer), changed(
        "multiprocessing.forkserver._forkserver", "is gone", where, todo
    )
    for attr in ("_forkserver_pid", "_forkserver_alive_fd", "_forkserver_address", "_lock"):
        assert hasattr(server, attr), changed(f"multiprocessing.forkserver._forkserver.{attr}", "is gone", where, todo)
    assert inspect.isfunction(forkserver.main), changed(
        "multiprocessing.forkserver.main", "is no longer a function", "forkserver.py (_in_the_server)", todo
    )


def test_cuda_bad_fork_flag():
    flag = getattr(torch.cuda, "_is_in_bad_fork", None)
    assert callable(flag) and flag() is False, changed(
        "torch.cuda._is_in_bad_fork",
        "is gone or no longer answers False in a process that never started CUDA",
        "ignite_mgpu/processes/forkserver.py (check_served_fork) and notebook.py (fork_is_poisoned)",
        "Find how this release tells that a forked process cannot start CUDA (torch.cuda.is_initialized() is "
        "false there), and use that.",
    )


def test_atexit_runs_the_exit_handlers_on_request():
    """A script's worker ends with os._exit; ``script.run_script`` runs the exit handlers first."""
    code = "import atexit, os; atexit.register(print, 'ran'); atexit._run_exitfuncs(); os._exit(0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout == "ran\n", changed(
        "atexit._run_exitfuncs",
        f"did not run a registered handler ({out.stderr.strip()[-300:]!r})",
        "ignite_mgpu/processes/script.py (run_script)",
        "Find how this Python runs the exit handlers without exiting, and use that.",
    )


def test_argparse_prints_through_one_private_method(monkeypatch, capsys):
    """Ranks but 0 silence argparse by replacing ``_print_message``: usage, errors, --help and --version."""
    from ignite_mgpu.processes import script

    where = "ignite_mgpu/processes/script.py (_quiet_argparse)"
    todo = "Silence this Python's argparse on ranks but 0 another way (print_usage, print_help, exit, version)."
    assert parameters(argparse.ArgumentParser._print_message) == ["self", "message", "file"], changed(
        "argparse.ArgumentParser._print_message", "takes other arguments", where, todo
    )
    monkeypatch.setattr(argparse.ArgumentParser, "_print_message", argparse.ArgumentParser._print_message)
    script._quiet_argparse()
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--version", action="version", version="1")
    parser.print_usage()
    parser.print_help()
    for argv in (["--version"], ["--nope"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    printed = capsys.readouterr()
    assert printed.out == printed.err == "", changed(
        "argparse.ArgumentParser._print_message", "no longer prints everything", where, todo
    )


# --------------------------------------------------------------------------------------------- the training layer


def test_ignite_logger_extension_points():
    from ignite.handlers.base_logger import BaseLogger, BaseOutputHandler

    todo = "Port the loggers to this ignite's BaseLogger and BaseOutputHandler."
    assert {"_create_output_handler", "_create_opt_params_handler"} <= BaseLogger.__abstractmethods__, changed(
        "ignite BaseLogger._create_output_handler / _create_opt_params_handler",
        "are no longer the methods a logger implements",
        "ignite_mgpu/train/tracking/csv_logger.py (CsvLogger)",
        todo,
    )
    helper = getattr(BaseOutputHandler, "_setup_output_metrics_state_attrs", None)
    assert helper is not None and "key_tuple" in parameters(helper), changed(
        "ignite BaseOutputHandler._setup_output_metrics_state_attrs",
        "is gone or has no key_tuple",
        "ignite_mgpu/train/tracking/csv_logger.py and mlflow_tracker.py (their OutputHandlers)",
        todo,
    )


def test_loss_and_accuracy_states_reduced_together():
    """``evaluator.reduce_together`` all-reduces these metrics' private sums in one collective; with other names it
    falls back to ignite's own reduction (right, but one collective per state)."""
    from ignite.metrics import Accuracy, Loss

    from ignite_mgpu.train.evaluator import JOINTLY_REDUCED, _reducible

    for metric in (Loss(nn.CrossEntropyLoss()), Accuracy()):
        assert _reducible(metric), changed(
            f"ignite {type(metric).__name__}'s states {JOINTLY_REDUCED[type(metric)]}",
            "were renamed (or compute is no longer wrapped by sync_all_reduce)",
            "ignite_mgpu/train/evaluator.py (JOINTLY_REDUCED)",
            "Put this ignite's names into JOINTLY_REDUCED.",
        )
    renamed = Accuracy()
    del renamed._num_correct  # as under a release that renamed it (a Metric answers any name: hasattr is no test)
    assert not _reducible(renamed)  # then ignite reduces it itself


def test_norm_layers_share_norm_base():
    base = getattr(nn.modules.batchnorm, "_NormBase", None)
    norms = (nn.BatchNorm2d, nn.SyncBatchNorm, nn.InstanceNorm2d, nn.LazyBatchNorm2d, nn.LazyInstanceNorm2d)
    assert isinstance(base, type) and all(issubclass(n, base) for n in norms), changed(
        "torch.nn.modules.batchnorm._NormBase",
        "is gone or no longer the base of BatchNorm*, SyncBatchNorm and InstanceNorm*",
        "ignite_mgpu/train/param_groups.py (NORMS: no weight decay on normalisation layers)",
        "Put this release's common base, or the public classes themselves, into NORMS.",
    )


def test_checkpoint_state_dict_key():
    from ignite.handlers import Checkpoint

    state = Checkpoint({"m": nn.Linear(1, 1)}, lambda *args: None).state_dict()
    assert list(state) == ["_saved"], changed(
        "ignite Checkpoint.state_dict()'s key '_saved'",
        f"is now {list(state)}",
        "ignite_mgpu/checkpoint/save.py (adopt_existing)",
        "Give load_state_dict this ignite's keys.",
    )


def test_compiled_module_keeps_the_original_as_orig_mod():
    module = nn.Linear(1, 1)
    compiled = torch.compile(module)
    assert getattr(compiled, "_orig_mod", None) is module, changed(
        "torch.compile's wrapper attribute _orig_mod",
        "is gone",
        "ignite_mgpu/parallel/strategy.py (unwrap, find_ddp) and parallel/fsdp.py (find_fsdp)",
        "Find how this release reaches the module inside torch.compile's wrapper, and use that.",
    )
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict()), changed(
        "torch.compile's state_dict prefix '_orig_mod.'",
        "changed",
        "ignite_mgpu/checkpoint/files.py (PREFIXES)",
        "Add this release's prefix to PREFIXES (keep the old one: older checkpoints hold it).",
    )


def test_numpy_pickles_name_the_reconstruct_function_we_allow():
    np = pytest.importorskip("numpy")
    from ignite_mgpu.checkpoint.files import _numpy_rng_globals

    module = "numpy._core.multiarray" if int(np.__version__.split(".")[0]) >= 2 else "numpy.core.multiarray"
    data = pickle.dumps(np.zeros(1, dtype=np.uint32), protocol=2)
    assert module.encode() in data and b"_reconstruct" in data, changed(
        f"{module}._reconstruct",
        "is no longer what numpy's arrays pickle with",
        "ignite_mgpu/checkpoint/files.py (_numpy_rng_globals: reading checkpoints with numpy RNG states)",
        "Allow the function this numpy's pickles name instead.",
    )
    with _numpy_rng_globals():  # the import inside must work on this numpy
        pass
