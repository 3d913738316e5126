"""The conda environment and pyproject.toml declare the same dependencies; the console script exists."""

from __future__ import annotations

import re

import tomllib
import yaml
from conftest import REPO

CONDA_NAMES = {"pytorch": "torch"}  # conda-forge package name -> PyPI name


def _split(spec: str) -> tuple[str, str]:
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", spec)
    assert m, spec
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def test_environment_yml_lists_the_same_dependencies_as_pyproject() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pip_deps = dict(_split(s) for s in pyproject["project"]["dependencies"])
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    conda = dict(_split(s) for s in env["dependencies"] if isinstance(s, str))
    conda = {CONDA_NAMES.get(k, k): v for k, v in conda.items() if k not in ("python", "pip")}
    assert conda == pip_deps


def test_console_script_points_at_the_cli() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["workbench"] == "workbench.cli:main"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    command = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest'
    assert command in readme
    assert command in (REPO / ".ci" / "run").read_text()


def test_every_subpackage_and_data_file_ships_in_the_wheel() -> None:
    """An editable install finds everything; a wheel only what pyproject lists."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "workbench").rglob("__init__.py")
    }
    assert packages <= set(setuptools["packages"]), sorted(packages - set(setuptools["packages"]))
    for data in (REPO / "workbench").rglob("*.yaml"):
        package = ".".join(data.parent.relative_to(REPO).parts)
        assert any(data.match(glob) for glob in setuptools["package-data"].get(package, [])), data
