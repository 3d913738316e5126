"""The package's shape, as docs/reference/structure.md draws it: no import cycle (lazy imports
included), the rank side importing only itself, a root of a few files, a long module saying why it
stays whole, linted and formatted as CI checks. And the suite's own: test ids that can't differ
between two collections."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import REPO

PACKAGE = REPO / "workbench"
LONG_MODULE = 500
MAX_ROOT_FILES = 8
LINE_WIDTH = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]

CALLER_SIDE = ("workbench.launcher", "workbench.commands", "workbench.cli", "workbench.estimator")
NOTEBOOK_SIDE = ("workbench.notebook", "workbench.regress")
HEAVY_LIBRARIES = ("matplotlib", "ipywidgets", "papermill", "nbformat", "IPython")


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


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def imports_of(name: str) -> set[str]:
    """Modules of the package that `name` imports anywhere (functions included, TYPE_CHECKING blocks not).

    `from x import y` is an import of x.y when that is a module, else of x. Importing a.b.c runs the package
    __init__ of a and a.b first, so those count too, the importer's own parents included: a rank that runs
    `python -m workbench.worker` executes workbench/__init__.py before the worker.
    """
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
            continue
        for target in _targets(node, package):
            parts = target.split(".")
            found.update(
                ".".join(parts[:i])
                for i in range(1, len(parts) + 1)
                if ".".join(parts[:i]) in MODULES
            )
    own = name.split(".")
    found.update(".".join(own[:i]) for i in range(1, len(own)))
    found.discard(name)
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])
    return cycles


def test_there_is_no_import_cycle() -> None:
    # A parent's __init__ runs before its children, so "a child imports its parent" is no cycle; a parent
    # whose __init__ imports a child that imports the parent back would be (ast can't tell which names the
    # parent already had), and the parent edges are checked for that below by importing each module alone.
    graph = {
        name: {m for m in imports_of(name) if not name.startswith(m + ".")} for name in MODULES
    }
    cycles = find_cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle() -> None:
    # The checker itself must be able to fail: on a graph with a cycle, and on an import inside a function.
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert "workbench.launcher.launch" in imports_of(
        "workbench.launcher.result"
    ) or "workbench.notebook.plots" in imports_of("workbench.launcher.result"), (
        "function-level imports count"
    )
    assert "workbench" in imports_of("workbench.worker"), "running a.b runs a/__init__ first"


def test_every_module_imports_on_its_own() -> None:
    # Each module first, in a fresh interpreter, with none of the package loaded before it (torch and the other
    # libraries stay loaded: one interpreter, as the suite's two workers keep both cores busy anyway)
    def code(names: list[str]) -> str:
        return "\n".join(
            [
                "import importlib, sys, torch",
                f"names = {names!r}",
                "for name in names:",
                "    for loaded in [m for m in sys.modules if m == 'workbench' or m.startswith('workbench.')]:",
                "        del sys.modules[loaded]",
                "    importlib.import_module(name)",
                "print('ok', len(names))",
            ]
        )

    names = sorted(MODULES)
    done = subprocess.run(
        [sys.executable, "-c", code(names)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.startswith(f"ok {len(names)}"), done.stderr[-3000:]


def _loaded_after(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def _outside_the_rank_side(loaded: list[str]) -> list[str]:
    return [
        m
        for m in loaded
        if m.startswith((*CALLER_SIDE, *NOTEBOOK_SIDE)) or m.split(".")[0] in HEAVY_LIBRARIES
    ]


@pytest.mark.parametrize(
    "statement",
    [
        "import workbench.worker",
        # what a rank goes on to import: the trainer, its parallel strategies and the checkpoint code
        "import workbench.worker, workbench.training.loop, workbench.training.parallel.pipeline",
    ],
    ids=["worker", "worker-trainer-pipeline"],
)
def test_a_rank_loads_only_the_rank_side(statement: str) -> None:
    loaded = _loaded_after(statement)
    assert "workbench.worker" in loaded and "workbench.rundir" in loaded
    assert _outside_the_rank_side(loaded) == []


def test_the_rank_side_check_sees_the_caller_side() -> None:
    # The check above must be able to fail: the caller's launcher is outside the rank side, and so is what
    # a panel loads.
    assert "workbench.launcher.launch" in _outside_the_rank_side(
        _loaded_after("import workbench.launcher.launch")
    )
    assert "ipywidgets" in _outside_the_rank_side(_loaded_after("import workbench as wb; wb.Panel"))


def test_import_workbench_is_cheap_and_the_public_names_resolve() -> None:
    loaded = _loaded_after("import workbench")
    assert [m for m in loaded if m.startswith("workbench")] == ["workbench", "workbench.version"]
    assert "torch" not in loaded
    import workbench as wb

    for name in wb.__all__:
        assert getattr(wb, name) is not None, name
    assert callable(wb.launch) and callable(wb.estimate) and callable(wb.start)


def test_the_root_holds_a_few_files() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_FILES, root


def test_a_long_module_says_why_and_lines_fit_the_width() -> None:
    """No god modules: a module is one concern, and one over LONG_MODULE lines says in its docstring
    why it stays whole (the word 'whole' or 'together'); no line is wider than the formatter's."""
    unexplained, wide = [], []
    for name, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        doc = (ast.get_docstring(ast.parse(source)) or "").lower()
        if len(lines) > LONG_MODULE and not ("whole" in doc or "together" in doc):
            unexplained.append(f"{name}: {len(lines)} lines")
        wide += [
            f"{name}:{i}: {len(line)} characters"
            for i, line in enumerate(lines, 1)
            if len(line) > LINE_WIDTH
        ]
    assert unexplained == [] and wide == []


def test_the_tree_is_linted_and_formatted_as_ci_checks() -> None:
    """ruff's rules and its formatter (at the configured line length) pass on the repository, and CI runs
    both, so a change that skips the formatter fails here before it fails CI."""
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^ruff check \.$", ci, re.M) and re.search(
        r"^ruff format --check \.$", ci, re.M
    )
    assert LINE_WIDTH == 100
    for command in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *command],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"ruff {' '.join(command)}:\n{done.stdout}{done.stderr}"


# ---- test ids ------------------------------------------------------------------------------------
def test_a_test_id_that_could_differ_between_collections_fails(tmp_path: Path) -> None:
    """The suite's own hooks (tests/collected_ids.py) fail a test whose id holds bytes (a .tar.gz built at
    collection: gzip's header holds the current second, so two xdist workers could collect different ids) or an
    object's memory address, and leave a plainly named one alone."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(
        "from collected_ids import mark_unstable_ids, pytest_runtest_setup\n\n"
        "def pytest_collection_modifyitems(items):\n"
        "    mark_unstable_ids(items)\n"
    )
    (tmp_path / "test_ids.py").write_text(
        "import gzip, io, tarfile\nimport pytest\n\n"
        "def packed():\n    buf = io.BytesIO()\n"
        "    with tarfile.open(fileobj=buf, mode='w:gz') as tar:\n        tar.addfile(tarfile.TarInfo('x'))\n"
        "    return buf.getvalue()\n\n"
        "@pytest.mark.parametrize('archive', [packed()])\ndef test_bytes(archive):\n    pass\n\n"
        "@pytest.mark.parametrize('thing', [object()], ids=repr)\ndef test_address(thing):\n    pass\n\n"
        "@pytest.mark.parametrize('n, text', [(1, 'plain')])\ndef test_plain(n, text):\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 1, report
    assert "1 passed, 2 errors" in report, report
    assert re.search(r"ERROR .*test_bytes\[\\x1f\\x8b", report), report
    assert "its id holds escaped bytes; name each parameter with ids=" in report, report
    assert "its id holds a memory address" in report, report


def test_what_makes_an_id_unstable_is_named() -> None:
    from collected_ids import unstable_id

    # the id that made two workers disagree (issue 39), and its stable replacement
    assert (
        unstable_id(
            r"tests/test_data.py::test_unsafe_archive_member_is_refused[a.tar.gz-\x1f\x8b\x08\x00"
            r"\xe2(\nk\x02]"
        )
        == "its id holds escaped bytes"
    )
    assert (
        unstable_id("tests/test_data.py::test_unsafe_archive_member_is_refused[tar-dotdot]") is None
    )
    assert (
        unstable_id("t.py::test_x[<object object at 0x7f3a2c1b9e40>]")
        == "its id holds a memory address"
    )
    assert unstable_id("t.py::test_x[<Foo object>]") == "its id holds an object's repr"
    assert (
        unstable_id("t.py::test_x[" + "x" * 81 + "]")
        == "its parameter id is 81 characters long (at most 80)"
    )
    assert unstable_id("t.py::test_x") is None


def test_the_files_scheduled_first_exist() -> None:
    """conftest.LONGEST_FIRST orders the suite for its two workers: a renamed file would silently drop to the
    end of the order, where a long one keeps a worker busy alone."""
    from conftest import LONGEST_FIRST

    tests = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    assert [name for name in LONGEST_FIRST if name not in tests] == []


SIGNAL_OWNER = "workbench.utils.preemption"
"""The one module that installs the handlers of the signals a run reacts to, on the caller's side and the rank
side alike; everyone else calls it. No exceptions: Ctrl-C's handler for `workbench train` is
installed there too."""


def signal_installations(source: str) -> list[int]:
    """The lines of `source` that install a signal handler: `signal.signal(...)`, however `signal` was imported
    (`from signal import signal` included)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "signal"
            or isinstance(func, ast.Name)
            and func.id == "signal"
        ):
            lines.append(node.lineno)
    return lines


def test_one_module_installs_the_signal_handlers() -> None:
    found = {
        name: lines
        for name, path in MODULES.items()
        if name != SIGNAL_OWNER and (lines := signal_installations(path.read_text()))
    }
    assert found == {}, (
        f"signal handlers installed outside {SIGNAL_OWNER} (call it instead): {found}"
    )
    assert signal_installations(MODULES[SIGNAL_OWNER].read_text()), "the owner installs them"


def test_the_signal_check_finds_an_installation() -> None:
    assert signal_installations("import signal\nsignal.signal(signal.SIGTERM, print)\n") == [2]
    assert signal_installations("from signal import signal\nsignal(15, print)\n") == [2]
    assert signal_installations("import signal\nsignal.getsignal(signal.SIGTERM)\n") == []


# ---- the parallel layer: one mesh, declared capabilities, DCP's state-dict API (issue 38)
# -------------------
PROBED = ("strategy", "accelerator", "parallel")
"""Names a getattr must not probe: a strategy's and an accelerator's capabilities are declared attributes."""


def calls_of(source: str, function: str) -> list[int]:
    """The lines of `source` that call `function`, by name or as an attribute (`device_mesh.init_device_mesh`)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and (
            isinstance(node.func, ast.Name)
            and node.func.id == function
            or isinstance(node.func, ast.Attribute)
            and node.func.attr == function
        )
    ]


def probes(source: str) -> list[int]:
    """The lines of `source` with getattr(x, ...) where x is a strategy or an accelerator: `strategy`,
    `accelerator`, `self.parallel`, `self.strategy`, `self.accelerator`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
        ):
            target = node.args[0] if node.args else None
            name = (
                target.id
                if isinstance(target, ast.Name)
                else target.attr
                if isinstance(target, ast.Attribute)
                else ""
            )
            if name in PROBED:
                lines.append(node.lineno)
    return lines


def checkpoint_overrides(source: str) -> dict[str, str]:
    """{'Class.save' or 'Class.load': its docstring} for every class but the base Strategy."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name != "Strategy":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in ("save", "load"):
                    found[f"{node.name}.{item.name}"] = ast.get_docstring(item) or ""
    return found


def test_one_mesh_builder_no_probes_and_at_most_two_checkpoint_overrides() -> None:
    training = {
        name: path.read_text()
        for name, path in MODULES.items()
        if name.startswith("workbench.training")
    }
    meshes = {
        name: lines
        for name, source in training.items()
        if (lines := calls_of(source, "init_device_mesh"))
    }
    assert meshes == {
        "workbench.training.parallel.device_mesh": meshes.get(
            "workbench.training.parallel.device_mesh"
        )
    }
    assert sum(len(lines) for lines in meshes.values()) == 1, meshes
    probing = {name: lines for name, source in training.items() if (lines := probes(source))}
    assert probing == {}, (
        f"capabilities probed with getattr (declare them on Strategy / Placement): {probing}"
    )
    overrides = {
        where: doc
        for name, source in training.items()
        if name.startswith("workbench.training.parallel")
        for where, doc in checkpoint_overrides(source).items()
    }
    assert len(overrides) <= 2, (
        f"save/load overridden beyond the two documented exceptions: {sorted(overrides)}"
    )
    assert [where for where, doc in overrides.items() if "why" not in doc.lower()] == [], overrides


def test_the_parallel_layer_checks_can_fail() -> None:
    assert calls_of(
        "from torch.distributed import device_mesh as dm\ndm.init_device_mesh('cpu', (2,))\n"
        "init_device_mesh('cpu', (2,))\n",
        "init_device_mesh",
    ) == [2, 3]
    assert probes(
        "getattr(strategy, 'pipelined', False)\ngetattr(self.parallel, 'loss_ranks', None)\n"
        "getattr(accelerator, 'tracing', False)\ngetattr(info, 'buffer', None)\n"
    ) == [1, 2, 3]
    assert checkpoint_overrides(
        "class Strategy:\n    def load(self, p): ...\n"
        "class Mine(Strategy):\n    def load(self, p):\n        '''Why: x.'''\n"
        "    def save(self, p): ...\n"
    ) == {"Mine.load": "Why: x.", "Mine.save": ""}


# ---- rooms by concern (issue 44) ------------------------------------------------------------------
TRAINER_MODULE = "workbench.training.loop"
SUBPACKAGES = (
    "workbench.training.checkpoint",
    "workbench.training.observe",
    "workbench.estimator.trace",
    "workbench.estimator.machine",
)


def trainer_takers(source: str) -> list[str]:
    """Functions of `source` with a parameter annotated as the Trainer (`t: Trainer`, `"Trainer"`), and
    calls that hand `self` to another function (`after_step(self, ...)`): the Trainer's behaviour living
    outside its class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for arg in args:
                note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if re.fullmatch(r"['\"]?(\w+\.)*Trainer['\"]?", note):
                    found.append(f"{node.name}({arg.arg}: {note})")
        elif isinstance(node, ast.Call):
            given = [*node.args, *(k.value for k in node.keywords)]
            if any(isinstance(a, ast.Name) and a.id == "self" for a in given):
                found.append(f"line {node.lineno}: {ast.unparse(node.func)}(self, ...)")
    return found


def test_the_trainers_behaviour_lives_in_its_class() -> None:
    takers = {
        name: found
        for name, path in MODULES.items()
        if name != TRAINER_MODULE and (found := trainer_takers(path.read_text()))
        if any("Trainer" in f for f in found)
    }
    assert takers == {}, f"functions taking the Trainer outside {TRAINER_MODULE}: {takers}"
    handed = trainer_takers(MODULES[TRAINER_MODULE].read_text())
    assert [f for f in handed if "(self, ...)" in f] == [], (
        f"the Trainer hands itself to other modules' functions: {handed}"
    )


def test_the_trainer_check_can_fail() -> None:
    assert trainer_takers("def after_step(t: Trainer, x): ...\n") == ["after_step(t: Trainer)"]
    assert trainer_takers("def f(t: 'loop.Trainer'): ...\n") == ["f(t: 'loop.Trainer')"]
    assert trainer_takers("class T:\n    def g(self):\n        finish(self, 1)\n") == [
        "line 3: finish(self, ...)"
    ]
    assert trainer_takers("def f(cfg: RunConfig): ...\nx = g(self.run)\n") == []


def test_related_modules_live_in_subpackages() -> None:
    missing = [name for name in SUBPACKAGES if name not in MODULES]
    assert missing == [], f"subpackages expected: {missing}"
    prefixed = sorted(
        name
        for name in MODULES
        if re.fullmatch(
            r"workbench\.(training\.checkpoint_\w+|estimator\.(trace|machine)_\w+)", name
        )
        or re.fullmatch(r"workbench\.notebook\.panel\.panel_\w+", name)
    )
    assert prefixed == [], (
        f"modules named by a prefix instead of living in a subpackage: {prefixed}"
    )


WRITERS = {"write_json", "write_jsonl", "append_jsonl", "atomic_write_bytes", "atomic_write_text"}
"""workbench.utils.files' writers: the path is their first argument."""
PATH_WRITERS = {"write_text", "write_bytes", "mkdir", "touch", "unlink", "rename", "rmdir"}
"""pathlib's: the path is the object they are called on."""
RUN_PATH = re.compile(r"\brun(_dir|dir)?\b|\.run\b|\brun\.\w+_path\b|\brun_path\b")
"""A path expression rooted in a run directory: `run.path / X`, `run_dir / X`, `self.run.stacks_path`."""

OTHER_WRITERS = {
    "workbench.training.checkpoint": "checkpoints/: the checkpointer owns its step folders (DCP)"
}
"""Subpackages that write into a run directory through a library of their own, and why."""


def run_dir_writes(source: str) -> list[str]:
    """The lines of `source` that write into a run directory without RunDir: a writer called on a path
    rooted in one, directly or through a local name (`marker = run.path / X; marker.write_text(...)`)."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases = {
            target.id
            for node in ast.walk(fn)
            if isinstance(node, ast.Assign) and RUN_PATH.search(ast.unparse(node.value))
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            func, target = node.func, None
            if isinstance(func, ast.Name) and func.id in WRITERS and node.args:
                target = node.args[0]
            elif isinstance(func, ast.Attribute) and func.attr in WRITERS and node.args:
                target = node.args[0]
            elif isinstance(func, ast.Attribute) and func.attr in PATH_WRITERS:
                target = func.value
            elif isinstance(func, ast.Name) and func.id == "open" and len(node.args) > 1:
                mode = node.args[1]
                if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax"):
                    target = node.args[0]
            if target is None:
                continue
            text = ast.unparse(target)
            if RUN_PATH.search(text) or text in aliases:
                found.append(f"line {node.lineno}: {ast.unparse(func)}({text})")
    return sorted(set(found))


def test_only_rundir_writes_into_a_run_directory() -> None:
    writes = {
        name: found
        for name, path in MODULES.items()
        if not name.startswith(("workbench.rundir", *OTHER_WRITERS))
        and (found := run_dir_writes(path.read_text()))
    }
    assert writes == {}, f"direct writes into a run directory (use a RunDir method): {writes}"


def test_the_run_dir_writer_check_can_fail() -> None:
    assert run_dir_writes("write_json(run.path / 'autobatch.json', {})\n") == [
        "line 1: write_json(run.path / 'autobatch.json')"
    ]
    assert run_dir_writes(
        "def f(run):\n    marker = run.path / ATTEMPT\n    marker.write_text('1')\n"
    ) == ["line 3: marker.write_text(marker)"]
    assert run_dir_writes("self.run.stacks_path.mkdir(parents=True)\n") == [
        "line 1: self.run.stacks_path.mkdir(self.run.stacks_path)"
    ]
    assert run_dir_writes("atomic_write_bytes(run_dir / TASK, b'')\n") != []
    assert run_dir_writes("write_json(out / 'bench.json', {})\nrun.write_autobatch({})\n") == []


RECIPE = "apply_parallelism"
"""training/parallel/apply.py's recipe: fp8, the pipeline split, tp, AC, compile, FSDP2/replicate/DDP,
compile='model', in that order; the strategies receive its result."""


def test_the_parallelize_recipe_has_one_call_site() -> None:
    sites = {
        name: lines
        for name, path in MODULES.items()
        if (lines := calls_of(path.read_text(), RECIPE))
    }
    assert list(sites) == ["workbench.training.parallel"] and len(sites[list(sites)[0]]) == 1, sites
    defined = [
        node.name
        for node in ast.walk(ast.parse(MODULES["workbench.training.parallel.apply"].read_text()))
        if isinstance(node, ast.FunctionDef)
    ]
    assert RECIPE in defined
