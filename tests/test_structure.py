"""The package's shape: no import cycles, modules that import on their own, the worker on the rank side only,
and modules and functions small enough to read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "workbench"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str) -> set[str]:
    """Modules of the package that `name` imports anywhere (functions included, TYPE_CHECKING blocks not).

    `from .x import y` is an import of x.y when that is a module, else of x; importing a.b.c also runs the
    package __init__ of a and a.b, so those count too (except the importer's own parents, which are already
    initialised when it runs).
    """
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in MODULES and prefix != name and not name.startswith(prefix + "."):
                    found.add(prefix)
    return found


def test_there_is_no_import_cycle() -> None:
    graph = {name: imports_of(name) for name in MODULES}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in MODULES:
        if name not in state:
            visit(name, [name])
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle() -> None:
    # The checker itself must be able to fail: recording imports the rules, judging imports recording.
    assert "workbench.regress.rules" in imports_of("workbench.regress.recording")
    assert "workbench.regress.recording" in imports_of("workbench.regress.judging")
    assert "workbench.regress" in imports_of("workbench.regress.recording"), "importing a.b runs a/__init__ too"


def test_every_module_imports_on_its_own() -> None:
    # Each module first, in a fresh interpreter, with none of the package loaded before it (torch stays); the
    # modules split between two interpreters running side by side (the check re-imports a lot).
    def code(names: list[str]) -> str:
        return "\n".join([
            "import importlib, sys, torch",
            f"names = {names!r}",
            "for name in names:",
            "    for loaded in [m for m in sys.modules if m == 'workbench' or m.startswith('workbench.')]:",
            "        del sys.modules[loaded]",
            "    importlib.import_module(name)",
            "print('ok', len(names))",
        ])

    names = sorted(MODULES)
    procs = [subprocess.Popen([sys.executable, "-c", code(names[i::2])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)]
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0 and out.startswith("ok"), err[-3000:]
    finally:
        for proc in procs:
            proc.kill()


def test_the_worker_imports_only_the_rank_side() -> None:
    reached, todo = set(), ["workbench.worker"]
    while todo:
        name = todo.pop()
        for nxt in imports_of(name) - reached:
            reached.add(nxt)
            todo.append(nxt)
    caller_side = {"workbench.launcher.api", "workbench.launcher.supervisor", "workbench.launcher.postmortem", "workbench.notebook.panel",
                   "workbench.notebook.dashboard", "workbench.regress.recording", "workbench.cli"}
    assert "workbench.training.rank" in reached and "workbench.training" in reached
    assert reached & caller_side == set()


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for name, path in MODULES.items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert too_long == []
