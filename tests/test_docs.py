"""The docs site: its generated pages come from the code (every RunConfig field, every CLI subcommand, the benchmark
results with or without their `measured_on` stamp), and, where mkdocs is installed (`pip install -e ".[docs]"`),
`mkdocs build --strict` passes: no broken link or anchor, no page outside the nav, no missing reference."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
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
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    assert 'id="micro_batch_size"' in (site / "reference" / "config" / "index.html").read_text()
    assert "workbench bench overhead" in (site / "reference" / "cli" / "index.html").read_text()
    for notebook in (REPO / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / notebook.stem / "index.html").is_file(), notebook.name
