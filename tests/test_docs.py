"""The docs site: its generated pages come from the code (every RunConfig field, every CLI subcommand, a page per
public Python object, the benchmark results with or without their `measured_on` stamp); the notebooks render
without the outputs meant for the regression suite alone; the README's and the guides' facts match the tree; and,
where mkdocs is installed (`pip install -e ".[docs]"`), scripts/docs-build passes: `mkdocs build --strict` with
no broken link or anchor, no page outside the nav, no missing reference, and no warning of any kind."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

HOOKS = REPO / "docs" / "hooks"


def _hook(name: str) -> ModuleType:
    """A docs/hooks/ module, loaded from its file as mkdocs loads it."""
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", HOOKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script(name: str) -> ModuleType:
    """A scripts/ file (no .py suffix), loaded as a module without running its main()."""
    loader = importlib.machinery.SourceFileLoader(f"script_{name}", str(REPO / "scripts" / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_runconfig_reference_has_a_row_per_field_with_its_default() -> None:
    from workbench.config import RunConfig

    table = _hook("config_reference").fields_table()
    rows = [line for line in table.splitlines() if line.startswith("| <span id=")]
    assert len(rows) == len(dataclasses.fields(RunConfig))
    for f, row in zip(dataclasses.fields(RunConfig), rows):
        assert f'id="{f.name}"' in row and f"`{f.name}`" in row
    parallelism = next(r for r in rows if 'id="parallelism"' in r)
    assert "`'ddp'`" in parallelism and "`'zero3'`" in parallelism  # the default and the choices


def test_the_cli_reference_has_every_command_and_subcommand() -> None:
    from workbench import cli

    text = _hook("cli_reference").cli_reference()

    def names(parser: argparse.ArgumentParser) -> list[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return [n for s in subs for p in s.choices.values() for n in (p.prog, *names(p))]

    progs = names(cli._parser())
    assert "workbench bench estimate-speed" in progs
    for prog in progs:
        assert f"# `{prog}`" in text, prog


def test_benchmark_tables_show_the_newest_result_per_device_class_stamped_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = _hook("benchmarks")
    results = tmp_path / "benchmarks" / "results" / "demo"
    results.mkdir(parents=True)
    stamp = {
        "date": "2026-01-02T00:00:00+00:00",
        "cpu": "AMD EPYC",
        "cores": "2",
        "gpus": [],
        "device_class": "cpu",
    }
    (results / "old.json").write_text(
        json.dumps(
            {"measured_on": {**stamp, "date": "2026-01-01"}, "rows": [{"mode": "ddp", "ms": [9.0]}]}
        )
    )
    (results / "new.json").write_text(
        json.dumps({"measured_on": stamp, "rows": [{"mode": "ddp", "ms": [1.0, 3.0]}]})
    )
    (results / "2025-12-31-unstamped.json").write_text(
        json.dumps({"device": "cuda", "ratio": 1.05})
    )
    monkeypatch.setattr(hook, "RESULTS", tmp_path / "benchmarks" / "results")
    text = hook.bench_section("demo")
    # the newest, medians
    assert "new.json" in text and "old.json" not in text and "| ddp | 2 |" in text
    # no measured_on
    assert "**cuda**" in text and "measured 2025-12-31" in text and "| 1.05 |" in text
    others = hook.on_page_markdown("<!-- generated: bench-results-others -->", None, None, None)
    assert "### `demo`" in others


def test_the_python_api_has_a_page_per_public_object_and_runconfig_fields_only_on_theirs() -> None:
    import dataclasses

    import workbench
    from workbench.config import RunConfig

    hook = _hook("api_reference")
    pages = hook._objects()
    documented = [name for names in pages.values() for name in names]
    assert sorted(documented) == sorted([*workbench._HOMES, *workbench._PACKAGES])
    assert pages["errors"] == [n for n in workbench._HOMES if n.endswith(("Error", "Locked"))]
    assert all(len(names) == 1 for page, names in pages.items() if page != "errors")

    runconfig = hook.page_markdown("runconfig", pages["runconfig"])
    members = re.findall(r"^\s+- (\w+)$", runconfig, flags=re.M)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    assert {"replace", "from_yaml", "to_yaml", "global_batch_size"} <= set(members)
    assert not fields & set(members), "a RunConfig field repeated on its API page"
    assert "](../config.md)" in runconfig

    table = hook.overview_table()
    for page, names in pages.items():
        for name in names:
            assert f"[`wb.{name}`](api/{page}.md)" in table

    class Config:
        nav = [
            {
                "Reference": [
                    {"RunConfig fields": "reference/config.md"},
                    {"Python API": hook.OVERVIEW},
                ]
            }
        ]

    section = hook.on_config(Config()).nav[0]["Reference"][1]["Python API"]
    assert section[0] == {"Overview": hook.OVERVIEW} and len(section) == 1 + len(pages)


def test_notebook_pages_leave_out_the_outputs_only_the_regression_suite_reads(
    tmp_path: Path,
) -> None:
    from workbench.regress.recording import CURVE_MIME, METRIC_MIME

    shown = {"output_type": "display_data", "data": {"text/html": "<b>fits</b>"}, "metadata": {}}
    recorded = [
        {"output_type": "display_data", "data": {mime: {"name": "loss"}}, "metadata": {}}
        for mime in (METRIC_MIME, CURVE_MIME)
    ]
    notebook = tmp_path / "n.ipynb"
    cell = {"cell_type": "code", "source": "x", "metadata": {}, "outputs": [shown, *recorded]}
    notebook.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4}))
    copy = json.loads(_hook("external_files")._shown(notebook))
    assert copy["cells"][0]["outputs"] == [shown]


def test_docs_build_counts_every_kind_of_warning() -> None:
    build = _script("docs-build")
    output = """\
INFO    -  Building documentation to directory: /tmp/site
INFO    -  Converting notebook (execute=False): /work/notebooks/01_quickstart.ipynb
/x/display_priority.j2:32: UserWarning: Your element with mimetype(s) dict_keys(['a']) is not able to be represented.
INFO    -  Formatting signatures requires either Black or Ruff to be installed.
WARNING -  Doc file 'index.md' contains a link 'nowhere.md', but the target is not found among documentation files.
/x/y.py:3: DeprecationWarning: old
INFO    -  Documentation built in 12.45 seconds"""
    found = build.warnings_in(output)
    assert [line.split(":")[0][:12] for line in found] == [
        "/x/display_p",
        "INFO    -  F",
        "WARNING -  D",
        "/x/y.py",
    ]
    assert build.warnings_in("INFO    -  Documentation built in 3 seconds") == []


def test_the_run_directory_guide_lists_every_file_a_run_can_have() -> None:
    from workbench import rundir
    from workbench.rundir.scheduler import JOB_FILE

    listing = (REPO / "docs" / "guides" / "run-directory.md").read_text().split("```text")[1]
    listing = listing.split("```")[0]
    names = {
        getattr(rundir.run_dir, constant)
        for constant in dir(rundir.run_dir)
        if constant.isupper() and isinstance(getattr(rundir.run_dir, constant), str)
    } | {JOB_FILE}
    missing = [n for n in sorted(names) if not re.search(rf"(^|\s|/){re.escape(n)}\b", listing)]
    assert not missing, f"docs/guides/run-directory.md's listing misses {missing}"


def test_the_readme_and_the_docs_give_one_test_time_and_every_docs_image_is_shown() -> None:
    def minutes(path: Path) -> set[str]:
        return set(re.findall(r"about (\d+) minutes", path.read_text()))

    readme, started = minutes(REPO / "README.md"), minutes(REPO / "docs" / "getting-started.md")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert len(readme) == 1 and readme == started, (readme, started)
    assert f"about {next(iter(readme))} minutes" in pyproject
    pages = (
        "".join(p.read_text() for p in (REPO / "docs").rglob("*.md"))
        + (REPO / "README.md").read_text()
    )
    unshown = [png.name for png in (REPO / "docs").glob("*.png") if png.name not in pages]
    assert not unshown, f"images in docs/ that no page shows: {unshown}"


def test_the_changelog_is_release_notes_for_users() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert "development story" not in text.lower()
    assert text.splitlines()[0] == "# Changelog" and "## Unreleased" in text
    diary = re.findall(
        r"\b(issue \d+|items? \d+|this (?:2-core )?box|no GPU was)", text, flags=re.I
    )
    assert not diary, diary


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_docs_build_strictly(tmp_path: Path) -> None:
    missing = [
        m
        for m in ("mkdocs", "material", "mkdocs_jupyter", "mkdocstrings_handlers.python")
        if importlib.util.find_spec(m.split(".")[0]) is None
    ]
    if missing:
        pytest.skip(
            f'the docs extra is not installed ({", ".join(missing)}): pip install -e ".[docs]"'
        )
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "docs-build"), "-d", str(site)],
        cwd=REPO,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    # strict, and no warning of any kind (the script fails on those too)
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    assert 'id="micro_batch_size"' in (site / "reference" / "config" / "index.html").read_text()
    assert "workbench bench overhead" in (site / "reference" / "cli" / "index.html").read_text()
    for notebook in (REPO / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / notebook.stem / "index.html").is_file(), notebook.name
    runconfig = (site / "reference" / "api" / "runconfig" / "index.html").read_text()
    assert 'id="workbench.config.RunConfig.replace"' in runconfig
    assert 'id="workbench.config.RunConfig.micro_batch_size"' not in runconfig
    assert (site / "reference" / "api" / "panel" / "index.html").is_file()
