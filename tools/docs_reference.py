"""The reference tables of the documentation, built from the code: every config key (type, default, and the
one-line comment after its field in the dataclasses) and the exit codes. Used by tools/gen_docs.py (mkdocs) and by
tests/test_docs.py."""

from __future__ import annotations

import ast
import html
from pathlib import Path

from ignite_mgpu.config.keys import Key, config_keys, sections
from ignite_mgpu.errors import EXIT_CODES


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    """A code cell of a Markdown table: a code span cannot hold an escaped pipe, so the cell is HTML."""
    return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"


def config_page() -> str:
    """The Markdown of reference/config.md."""
    out = [
        "# Configuration keys",
        "",
        "Generated from the dataclasses of `ignite_mgpu.config.schema`: the type and default of every field, and the "
        "comment written after it. Precedence: these defaults < the YAML file < `key=value` overrides < flags. "
        "`configs/default.yaml` lists the same keys with the same defaults (a test keeps them equal).",
        "",
    ]
    keys = config_keys()
    top = [k for k in keys if "." not in k.name]
    groups: list[tuple[str, str, list[Key]]] = [("Top level", "seed, output_dir and resume.", top)]
    for name, doc in sections().items():
        rows = [k for k in keys if k.name.startswith(name + ".")]
        groups.append((f"`{name}:`", doc, rows))
    for title, doc, rows in groups:
        out += [f"## {title}", "", doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{k.name}` | {_code(k.type)} | {_code(k.default)} | {_cell(k.meaning)} |" for k in rows]
        out.append("")
    return "\n".join(out)


def exit_codes_page() -> str:
    """The Markdown of reference/exit-codes.md, from errors.EXIT_CODES (the only copy of the table)."""
    out = [
        "# Exit codes",
        "",
        "Generated from `ignite_mgpu.errors.EXIT_CODES`, the one table the CLI's `--help`, the supervisor and "
        "`fit()` use. `launch()` in your own code raises `ConfigError` for the usage errors (code 2) and ends with "
        "`SystemExit` carrying the others.",
        "",
        "| code | meaning |",
        "|---|---|",
    ]
    out += [f"| {code} | {_cell(meaning)} |" for code, meaning in EXIT_CODES.items()]
    return "\n".join(out) + "\n"


ERROR_TYPES = {"ConfigError", "CheckpointError", "fail"}  # and every subclass (error_types)
RUNNING_JOB_ERRORS = {"ScriptArgumentsError"}  # raised in a worker, reported as its rank's failure: not listed here
COLLECTED = {"ConfigErrors"}  # several of the messages listed here, found together: printed as one numbered list


def error_types(package: Path) -> set[str]:
    """ERROR_TYPES and the package's classes that derive from one of them (GpusTaken, WaitTimedOut, ...), by name."""
    bases: dict[str, set[str]] = {}
    for file in package.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    types = set(ERROR_TYPES)
    while more := {name for name, of in bases.items() if of & types} - types:
        types |= more
    return types - RUNNING_JOB_ERRORS - COLLECTED


def _render(node: ast.expr | None, assigned: dict[str, ast.expr], helpers: dict[str, ast.expr]) -> str | None:
    """The text of a message expression, each computed part shown as `…`; a call of a function of the module that
    returns a message is that message; None when it is not a string."""
    if node is None:
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
        return _render(helpers[node.func.id], {}, {})
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left, assigned, helpers), _render(node.right, assigned, helpers)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Name) and node.id in assigned:
        return _render(assigned.pop(node.id), assigned, helpers)
    return None


def error_messages(package: Path) -> dict[str, list[str]]:
    """Module path -> every message a ConfigError / CheckpointError / the CLI's fail is raised with in it (the text
    as written, computed parts as `…`); a message built elsewhere shows the function that builds it."""
    found: dict[str, list[str]] = {}
    types = error_types(package)
    for file in sorted(package.rglob("*.py")):
        tree = ast.parse(file.read_text())
        helpers = {  # module functions that build a message: def f(...) -> str: ... return f"..."
            f.name: r.value
            for f in tree.body
            if isinstance(f, ast.FunctionDef)
            for r in ast.walk(f)
            if isinstance(r, ast.Return) and isinstance(r.value, (ast.JoinedStr, ast.Constant, ast.BinOp))
        }
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Module))]:
            assigned = {
                t.id: n.value
                for n in ast.walk(func)
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            body = func.body if isinstance(func, ast.Module) else [func]
            for node in (n for stmt in body for n in ast.walk(stmt)):
                if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) in types and node.args):
                    continue
                if ast.unparse(node.args[0]).startswith("str("):
                    continue  # an error caught and printed again: its message is listed where it is raised
                if isinstance(func, ast.Module) and any(
                    isinstance(f, ast.FunctionDef) and f.lineno <= node.lineno <= (f.end_lineno or 0)
                    for f in ast.walk(tree)
                ):
                    continue  # found again, with its function's assignments, from that function
                text = _render(node.args[0], dict(assigned), helpers)
                if text is None:
                    where = func.name if isinstance(func, ast.FunctionDef) else "the module"
                    text = f"(the message of `{ast.unparse(node.args[0])}`, in {where})"
                module = ".".join(file.relative_to(package.parent).with_suffix("").parts)
                found.setdefault(module, []).append(" ".join(text.split()))
    return found


def errors_page(package: Path) -> str:
    """The Markdown of reference/errors.md: every error paragraph the CLI and fit() can print, by module."""
    out = [
        "# Error messages",
        "",
        "Generated from the code: every message a configuration or checkpoint error is raised with, as written "
        "(`…` stands for the values filled in: the key, the value you gave, the file). Each is printed as "
        "`ignite-mgpu: error: <message>` with exit code 2 before anything starts (a corrupt `--resume` file: 1; "
        "`--wait` running out: 4; Ctrl-C while waiting: 130), "
        "and says how to fix it; several mistakes found together are printed at once, numbered, in the order checked. "
        "[Troubleshooting](../how-to/troubleshooting.md) covers the failures of a running "
        "job.",
        "",
    ]
    for module, messages in error_messages(package).items():
        out += [f"## `{module}`", ""]
        out += [f"- {m.replace('<', '&lt;')}" for m in dict.fromkeys(messages)]
        out.append("")
    return "\n".join(out)
