"""Where ``launch`` is called from. From a script, workers are spawned (a fresh interpreter imports the job function
by name) and a failed job exits (SystemExit). From a notebook or another interactive session, a function defined
there cannot be imported by a fresh interpreter, so the workers are forked from this process, which is safe only
while CUDA is untouched here; and a failed job raises ``JobFailed``.

Torch-free: torch is inspected only where it is already imported.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ignite_mgpu.errors import ConfigError

# torch.cuda.is_available() asks NVML instead of CUDA: fork stays safe.
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
_WHY_FORK = (
    "launch() starts the workers by fork from this session, since a fresh process cannot import a function "
    "defined in a notebook cell or at the prompt, and a forked process cannot use CUDA once its parent has "
)
_HOW_TO_FIX = (
    "Restart the kernel (or the interpreter) and call launch() before anything touches CUDA, keeping .cuda(), "
    ".to('cuda') and torch.cuda calls inside the function; or put the function in a .py file and import it, so "
    "that launch() spawns fresh processes instead."
)


# A worker's exit code when it found launch() called at the top level of the script it imports (no main guard).
NO_MAIN_GUARD = 86


def leave_if_importing_main() -> None:
    """In a worker that is importing the launching script (as ``__mp_main__``, to find the job function): a
    ``launch()`` there is the script's top level running again, without ``if __name__ == "__main__":``. The worker
    leaves at once with ``NO_MAIN_GUARD``, and the launcher says so once, where multiprocessing would print its
    long error in every worker (``outcome.py``)."""
    frame = inspect.currentframe()
    while frame is not None:  # multiprocessing.spawn.prepare() runs the script while a worker starts
        if frame.f_globals.get("__name__") == "multiprocessing.spawn" and frame.f_code.co_name == "prepare":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(NO_MAIN_GUARD)
        frame = frame.f_back


def no_main_guard(script: str) -> str:
    """The paragraph for workers that left with ``NO_MAIN_GUARD``."""
    name = os.path.basename(script) if script else "the script"
    return (
        f'{name} calls launch() at its top level, without `if __name__ == "__main__":`. Each worker imports '
        f"{name} to find the job function, which runs its top level, and so launch(), again (multiprocessing's "
        f'error: "An attempt has been made to start a new process before the current process has finished its '
        f'bootstrapping phase"). Put the launch() call, and whatever else should run once, under `if __name__ == '
        f'"__main__":` at the end of {name}; the job function stays at the top level.'
    )


def main_is_importable() -> bool:
    """Whether a spawned process can import this process's ``__main__`` (a script file); not for a notebook, the
    REPL, ``python -c`` or ``python -`` (stdin)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return isinstance(path, str) and os.path.isfile(path)


def interactive() -> bool:
    """A notebook (an IPython kernel), IPython, the REPL or ``python -i``: a failed job raises an exception there,
    where a script exits with the job's code."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_ipython is not None and get_ipython() is not None


def _from_main(obj: Any) -> bool:
    obj = getattr(obj, "func", obj)  # functools.partial
    return getattr(obj, "__module__", None) == "__main__" or type(obj).__module__ == "__main__"


def start_method(fn: Callable[..., Any] | str, args: tuple) -> str:
    """The start method of the workers: "fork" where a spawned one could not unpickle the job (the function, or one
    of its arguments, comes from a ``__main__`` that a fresh process cannot import: a notebook's cell), else
    "spawn"."""
    if main_is_importable() or not any(_from_main(obj) for obj in (fn, *args)):
        return "spawn"
    return "fork"


@contextlib.contextmanager
def fork_safe_cuda_queries(fork: bool) -> Iterator[None]:
    """While the plan is made: torch.cuda.is_available() counts the GPUs through NVML, which leaves this process
    able to fork workers that use CUDA (CUDA's own count would not)."""
    if not fork or _NVML_CHECK in os.environ:
        yield
        return
    os.environ[_NVML_CHECK] = "1"
    try:
        yield
    finally:
        os.environ.pop(_NVML_CHECK, None)


def check_fork_safe(device: str) -> None:
    """Refuse to fork workers from a process in which CUDA started, or was asked something (on a GPU plan).

    Raises:
        ConfigError: one paragraph: what touched CUDA, if known, and how to start again.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return  # nothing imported torch here: CUDA cannot have started
    if torch.cuda.is_initialized():
        holders = cuda_holders(vars(sys.modules["__main__"]))
        what = f": {', '.join(holders)}" if holders else " (torch.cuda.is_initialized() is true)"
        raise ConfigError(f"{_WHY_FORK}initialised it, and this one has{what}. {_HOW_TO_FIX}")
    if device == "cuda" and fork_is_poisoned():
        raise ConfigError(
            f"{_WHY_FORK}asked it anything, and this one has: a call such as torch.cuda.is_available() or "
            "torch.cuda.get_device_name() ran here before launch() (so CUDA would fail in every worker with "
            f"'Cannot re-initialize CUDA in forked subprocess'). {_HOW_TO_FIX} To keep asking before launch(), set "
            f"os.environ['{_NVML_CHECK}'] = '1' first (torch.cuda.is_available() then asks NVML)."
        )


def cuda_holders(namespace: dict[str, Any], at_most: int = 3) -> list[str]:
    """The variables of ``namespace`` (the notebook's) that hold a CUDA tensor or a module with CUDA parameters:
    what most likely initialised CUDA."""
    torch = sys.modules.get("torch")
    found: list[str] = []
    for name, value in namespace.items():
        if torch is None or len(found) >= at_most:
            break
        if name.startswith("_"):  # IPython's _, __, _1 ...: outputs, which repeat a variable
            continue
        tensor = value
        if isinstance(value, torch.nn.Module):
            tensor = next(iter([*value.parameters(), *value.buffers()]), None)
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            found.append(f"`{name}` is on {tensor.device}")
    return found


def fork_is_poisoned() -> bool:
    """Whether a process forked from this one now could not start CUDA: asked in a child that exits at once
    (torch keeps the answer in the child, only, behind a private name: tests/test_private_apis.py guards it)."""
    torch = sys.modules["torch"]
    pid = os.fork()
    # The child: one flag read, then out, without running any of the parent's exit handlers.
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 1
