"""Where launch() is called from, in-process: a function defined in a notebook (a ``__main__`` without a file) is
forked, everything else spawned; forking is refused once CUDA was touched, with what touched it; an interactive
session gets exceptions. Real kernels run in tests/distributed/test_notebooks.py.
`python -m pytest tests/processes/test_notebook.py`."""

import functools
import json
import os
import sys
import types

import pytest

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.processes import notebook


@pytest.fixture
def notebook_main(monkeypatch):
    """A ``__main__`` as a Jupyter kernel has it: a module without a file."""
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def defined_in(main, source, name):
    exec(compile(source, "<cell>", "exec"), vars(main))
    return vars(main)[name]


def test_a_script_always_spawns(notebook_main):
    notebook_main.__file__ = __file__  # a script's __main__ is a file (not a pytest-xdist worker's)
    assert notebook.main_is_importable()
    assert notebook.start_method(json.dumps, ()) == "spawn"
    assert notebook.start_method(lambda local_rank: None, ()) == "spawn"  # scripts keep today's behaviour


def test_a_function_or_argument_from_a_notebook_cell_is_forked(notebook_main):
    run = defined_in(notebook_main, "def run(local_rank):\n    return local_rank\n", "run")
    net = defined_in(notebook_main, "class Net:\n    pass\nnet = Net()\n", "net")
    assert not notebook.main_is_importable()
    assert notebook.start_method(run, ()) == "fork"
    assert notebook.start_method(functools.partial(run), ()) == "fork"
    assert notebook.start_method(json.dumps, (net,)) == "fork"  # spawn could not unpickle the Net either
    assert notebook.start_method(json.dumps, ({"lr": 0.1},)) == "spawn"  # importable: fresh processes


def test_stdin_counts_as_a_main_without_a_file(notebook_main):
    notebook_main.__file__ = "<stdin>"  # python - <<EOF
    assert not notebook.main_is_importable()


def test_an_interactive_session_is_recognised(monkeypatch):
    monkeypatch.delattr(sys, "ps1", raising=False)
    monkeypatch.setitem(sys.modules, "IPython", None)
    assert not notebook.interactive()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))  # a kernel
    assert notebook.interactive()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))  # imported only
    assert not notebook.interactive()
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # the REPL
    assert notebook.interactive()


class FakeTensor:
    def __init__(self, device):
        self.device, self.is_cuda = device, device.startswith("cuda")


class FakeModule:
    def __init__(self, *tensors):
        self.tensors = list(tensors)

    def parameters(self):
        return iter(self.tensors)

    def buffers(self):
        return iter([])


def fake_torch(initialised):
    cuda = types.SimpleNamespace(is_initialized=lambda: initialised)
    return types.SimpleNamespace(cuda=cuda, Tensor=FakeTensor, nn=types.SimpleNamespace(Module=FakeModule))


def test_forking_after_cuda_started_is_refused_naming_what_holds_it(notebook_main, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(initialised=True))
    notebook_main.x = FakeTensor("cpu")
    notebook_main.model = FakeModule(FakeTensor("cuda:0"))
    notebook_main._ = notebook_main.model  # IPython's last output repeats a variable
    refused = r"launch\(\) starts the workers by fork .* initialised it, and this one"
    with pytest.raises(ConfigError, match=refused) as e:
        notebook.check_fork_safe("cpu")
    assert ": `model` is on cuda:0. Restart the kernel" in str(e.value)
    assert "put the function in a .py file and import it" in str(e.value) and "\n" not in str(e.value)
    del notebook_main.model, notebook_main._
    with pytest.raises(ConfigError, match=r"\(torch.cuda.is_initialized\(\) is true\)\. Restart the kernel"):
        notebook.check_fork_safe("cuda")


def test_forking_after_cuda_was_asked_is_refused_on_a_gpu_plan(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(initialised=False))
    monkeypatch.setattr(notebook, "fork_is_poisoned", lambda: True)
    with pytest.raises(ConfigError, match=r"asked it anything, and this one has: a call such as torch.cuda.is_av"):
        notebook.check_fork_safe("cuda")
    notebook.check_fork_safe("cpu")  # the workers do not use CUDA
    monkeypatch.setattr(notebook, "fork_is_poisoned", lambda: False)
    notebook.check_fork_safe("cuda")
    monkeypatch.setitem(sys.modules, "torch", None)
    notebook.check_fork_safe("cuda")  # torch not imported here: nothing can have touched CUDA


def test_a_fork_here_could_use_cuda():
    import torch

    assert torch.cuda._is_in_bad_fork() is False and notebook.fork_is_poisoned() is False  # the real question


def test_the_plan_counts_gpus_through_nvml_while_forking(monkeypatch):
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    with notebook.fork_safe_cuda_queries(True):
        assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    with notebook.fork_safe_cuda_queries(False):
        assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")  # the user's own setting stays
    with notebook.fork_safe_cuda_queries(True):
        assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"
