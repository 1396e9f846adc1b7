"""The package's layers, read from its source with ``ast``: no import cycle (imports inside functions and under
TYPE_CHECKING count), the process layer and ``runs/`` never reach the training layer, the torch-free layers stay
torch-free when imported, no subpackage shadows a public name. `python -m pytest tests/test_layering.py`."""

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import ignite_mgpu
from tests.helpers import MEMORY_TRACKERS

PACKAGE = Path(ignite_mgpu.__file__).parent
# Imported without torch or ignite: the CLI's --help, the launcher and supervisor, `ignite-mgpu report`.
TORCH_FREE = (
    "ignite_mgpu.env",
    "ignite_mgpu.gpus",
    "ignite_mgpu.cpus",
    "ignite_mgpu.hangs",
    "ignite_mgpu.processes",
    "ignite_mgpu.runs",
    "ignite_mgpu.errors",
    "ignite_mgpu.config",
)
TORCH_FREE_ENTRIES = (
    "ignite_mgpu.cli.commands",
    "ignite_mgpu.cli.readers",
    "ignite_mgpu.jobs",
    "ignite_mgpu.scaling",
    "ignite_mgpu.preflight",
    "ignite_mgpu.text",
)
TRAINING_LAYER = ("ignite_mgpu.train", "ignite_mgpu.checkpoint", "ignite_mgpu.parallel", "ignite_mgpu.memory")
# The packages' rank table, lowest first: a module imports only modules of its own unit or of a lower rank (at module
# level, inside functions, under TYPE_CHECKING). A unit is one line: every module whose name starts with one of its
# prefixes (the longest prefix decides). The launch layer (processes/) ranks above the training layer that it starts by
# name: it never imports it (the torch-free test), and the training layer never imports the launcher.
RANKS: list[tuple[str, ...]] = [
    ("ignite_mgpu", "ignite_mgpu.errors", "ignite_mgpu.text"),  # the version, the errors, how messages write
    ("ignite_mgpu.runs",),  # run folders' names and reading them back
    ("ignite_mgpu.config",),
    ("ignite_mgpu.env",),  # what torchrun/SLURM say, the stop request, the clock
    ("ignite_mgpu.gpus",),
    ("ignite_mgpu.cpus",),
    ("ignite_mgpu.hangs",),  # a hang found and reported: the status files read, every rank's stacks
    ("ignite_mgpu.parallel",),  # wrapping a model: what the checkpoints and the training layer share
    ("ignite_mgpu.checkpoint",),
    ("ignite_mgpu.train.plugins",),  # the user's factories
    ("ignite_mgpu.train.data",),
    (
        "ignite_mgpu.train.models",
        "ignite_mgpu.train.losses",
        "ignite_mgpu.train.optim",
        "ignite_mgpu.train.param_groups",
        "ignite_mgpu.train.metrics",
        "ignite_mgpu.train.allocator",
    ),
    ("ignite_mgpu.train.step",),
    (
        "ignite_mgpu.train.evaluator",
        "ignite_mgpu.train.goodput",
        "ignite_mgpu.train.epoch_log",
        "ignite_mgpu.train.checkpointing",
    ),
    ("ignite_mgpu.train.tracking",),
    ("ignite_mgpu.train.default_job",),
    ("ignite_mgpu.train.measuring",),  # `ignite-mgpu scale`'s job: the default job's step, measured
    ("ignite_mgpu.memory",),  # `ignite-mgpu plan`, in the launching process
    ("ignite_mgpu.processes",),
    ("ignite_mgpu.preflight",),
    ("ignite_mgpu.jobs",),
    ("ignite_mgpu.scaling",),
    ("ignite_mgpu.cli.options",),
    ("ignite_mgpu.cli.readers",),
    ("ignite_mgpu.cli", "ignite_mgpu.__main__"),
]
# Imports against the table, each with its reason (none today).
AGAINST_THE_RANKS: set[tuple[str, str]] = set()
MAX_FOLDER_MODULES = 15
LEAVES = (
    "ignite_mgpu.errors",
    "ignite_mgpu.text",
    "ignite_mgpu.config.schema",
    "ignite_mgpu.config.checks",
    "ignite_mgpu.config.loading",
    "ignite_mgpu.runs.folder",
    "ignite_mgpu.runs.metric_names",
    "ignite_mgpu.runs.regular",
    "ignite_mgpu.runs.writable",
)  # import only each other
MAX_FUNCTION_LINES = 60
# Longer on purpose, each with its reason.
LONG_ON_PURPOSE: set[str] = set()  # a function that must stay long, with the reason beside it


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Every module of the package at ``root`` -> the package's modules it imports anywhere: at module level, inside
    functions and under ``if TYPE_CHECKING:`` (a deferred import that closes a loop is a cycle all the same)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..y import z
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for target in targets:
                while target and target not in paths:  # `from pkg.mod import func` imports pkg.mod
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for dep in sorted(graph.get(module, ())):
            if cycle := visit(dep, [*path, module]):
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module, []):
            return cycle
    return None


def in_layer(module: str, layers: tuple[str, ...]) -> bool:
    return any(module == layer or module.startswith(layer + ".") for layer in layers)


def rank_of(module: str, ranks: list[tuple[str, ...]] = RANKS) -> int:
    """The rank of ``module``'s unit: the line holding its longest matching prefix."""
    matches = [(len(prefix), rank) for rank, unit in enumerate(ranks) for prefix in unit if in_layer(module, (prefix,))]
    assert matches, f"{module} is in no unit of the rank table: add it to RANKS"
    return max(matches)[1]


def imports_against_ranks(graph: dict[str, set[str]], ranks: list[tuple[str, ...]] = RANKS) -> list[str]:
    """Every import of a module of a higher rank, as 'importer -> imported' (one rank is one unit)."""
    return sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if rank_of(dep, ranks) > rank_of(module, ranks)
    )


def test_packages_import_in_one_direction():
    found = [
        line
        for line in imports_against_ranks(import_graph(PACKAGE))
        if tuple(line.split(" -> ")) not in AGAINST_THE_RANKS
    ]
    assert found == [], "imports against the rank table (tests/test_layering.py RANKS):\n" + "\n".join(found)


def test_the_rank_check_fails_on_a_planted_import():
    graph = {module: set(deps) for module, deps in import_graph(PACKAGE).items()}
    assert imports_against_ranks(graph) == sorted(f"{a} -> {b}" for a, b in AGAINST_THE_RANKS)
    graph["ignite_mgpu.checkpoint.save"].add("ignite_mgpu.train.step.guard")  # checkpoint reaching up into train
    graph["ignite_mgpu.train.step.trainer"].add("ignite_mgpu.processes.worker")  # the training layer into the launcher
    graph["ignite_mgpu.env.stop"].add("ignite_mgpu.runs.folder")  # down: allowed
    found = imports_against_ranks(graph)
    assert "ignite_mgpu.checkpoint.save -> ignite_mgpu.train.step.guard" in found
    assert "ignite_mgpu.train.step.trainer -> ignite_mgpu.processes.worker" in found
    assert not [line for line in found if line.startswith("ignite_mgpu.env.stop")]


def test_folders_are_concepts_with_unique_module_names():
    modules = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts]
    for folder in {p.parent for p in modules} - {PACKAGE}:
        inside = sorted(p.stem for p in modules if p.parent == folder)
        assert len(inside) <= MAX_FOLDER_MODULES, (folder, inside)
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        unnamed = [m for m in inside if f"``{m}``" not in doc]
        assert not unnamed, f"{folder}/__init__.py's docstring names no ``{unnamed[0]}``: one line per module"
    names = sorted(p.name for p in modules if p.parent != PACKAGE or p.name != "__main__.py")
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_cycle_finder_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    planted = tmp_path / "planted"
    (planted / "sub").mkdir(parents=True)
    (planted / "__init__.py").write_text("")
    (planted / "sub" / "__init__.py").write_text("")
    (planted / "a.py").write_text("def f():\n    from planted.sub import b\n    return b\n")
    (planted / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from planted.c import C\n"
    )
    (planted / "c.py").write_text("class C:\n    def g(self):\n        from planted import a\n        return a\n")
    assert find_cycle(import_graph(planted)) == ["planted.a", "planted.sub.b", "planted.c", "planted.a"]
    (planted / "c.py").write_text("class C:\n    pass\n")
    assert find_cycle(import_graph(planted)) is None


def test_the_process_layer_and_runs_never_import_the_training_layer():
    graph = import_graph(PACKAGE)
    for module, deps in graph.items():
        if in_layer(module, TORCH_FREE):
            assert not {d for d in deps if in_layer(d, TRAINING_LAYER)}, module
            assert not {d for d in deps if in_layer(d, ("ignite_mgpu.jobs", "ignite_mgpu.preflight"))}, module


def test_leaves_import_only_leaves():
    graph = import_graph(PACKAGE)
    packages = {module_name(p, PACKAGE) for p in PACKAGE.rglob("__init__.py")}
    assert all(not graph[p] for p in packages)  # a package's __init__ imports nothing: importing a leaf stays light
    for leaf in LEAVES:
        assert graph[leaf] - packages <= set(LEAVES), (leaf, graph[leaf])
    assert not graph["ignite_mgpu.errors"] and not graph["ignite_mgpu.text"]


@pytest.mark.timeout(60)
def test_the_torch_free_layers_import_neither_torch_nor_ignite():
    modules = sorted(
        m for m in import_graph(PACKAGE) if in_layer(m, TORCH_FREE) and not m.endswith(".figure")
    )  # runs.figure imports matplotlib only when asked to draw, never torch
    modules += [*TORCH_FREE_ENTRIES, "ignite_mgpu.runs.figure"]
    check = (
        f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; "
        "print(sorted(m for m in ('torch', 'ignite', 'matplotlib') if m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith(('ignite_mgpu.train', 'ignite_mgpu.checkpoint'))))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []"
    assert "ignite_mgpu.processes.launcher" in modules and "ignite_mgpu.runs.read" in modules


@pytest.mark.timeout(60)
def test_the_default_jobs_workers_import_only_what_training_needs():
    # What the fork server preloads for the default job: not the config loader's OmegaConf, the figure's matplotlib,
    # or the packages that only a named model, dataset or tracker needs.
    check = (
        "import sys, importlib; from ignite_mgpu.processes import forkserver; "
        "from ignite_mgpu.processes.job import Job; "
        "[importlib.import_module(m) for m in forkserver.preload_for(Job('ignite_mgpu.train.default_job:training'))]; "
        "print(sorted(m for m in ('omegaconf', 'matplotlib', 'transformers', 'timm', 'tensorboard', 'mlflow', "
        "'wandb', 'psutil', 'torchvision') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_subpackage_or_module_shadows_a_public_name():
    for info in pkgutil.walk_packages(ignite_mgpu.__path__, "ignite_mgpu."):
        if info.name.startswith("ignite_mgpu.memory.") and not MEMORY_TRACKERS:
            continue  # the memory plan imports PyTorch's memory trackers, which PyTorch 2.4 lacks
        importlib.import_module(info.name)  # each sets its name as an attribute of its parent package
    for name in ignite_mgpu.__all__:
        value = getattr(ignite_mgpu, name)
        assert not isinstance(value, type(ignite_mgpu)), f"ignite_mgpu.{name} is the module {value.__name__}"
        home = importlib.import_module(ignite_mgpu._PUBLIC[name])
        assert value is getattr(home, name)
    from ignite_mgpu import fit, launch, training

    assert callable(launch) and callable(fit) and callable(training)


def test_the_top_level_holds_at_most_eight_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    found.append(f"{module_name(path, root)}.{node.name}")
    return found


def test_no_function_is_longer_than_sixty_lines():
    assert sorted(set(long_functions(PACKAGE)) - LONG_ON_PURPOSE) == []
    assert LONG_ON_PURPOSE <= set(long_functions(PACKAGE))  # an entry that is short now leaves the list


MAX_CLASS_ATTRIBUTES = 20


def crowded_classes(root: Path, most: int = MAX_CLASS_ATTRIBUTES) -> dict[str, int]:
    """Each class that assigns more than ``most`` attributes of ``self`` in its methods: state that outgrew one
    object (the supervisor once held 28). A frozen dataclass's fields are values, not state, and are not counted."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            assigned = {
                target.attr
                for sub in ast.walk(node)
                if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                for top in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
                for target in ast.walk(top)
                if isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            }
            if len(assigned) > most:
                found[f"{module_name(path, root)}.{node.name}"] = len(assigned)
    return found


def test_no_class_holds_more_than_twenty_attributes(tmp_path):
    assert crowded_classes(PACKAGE) == {}
    planted = tmp_path / "pkg"
    planted.mkdir()
    body = "".join(f"        self.a{i} = {i}\n" for i in range(21))
    (planted / "crowded.py").write_text(f"class Crowded:\n    def __init__(self):\n{body}")
    assert crowded_classes(planted) == {"pkg.crowded.Crowded": 21}  # the check sees one
