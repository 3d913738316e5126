"""wb.runs()'s HTML table reads one line a run at 1280 px (issue 47: run names and 'ddp x 2'
wrapped onto two lines in JupyterLab with the file browser open): no cell wraps, long names end in
an ellipsis with the whole name in a tooltip."""

from __future__ import annotations

import html
import os
import shutil
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from workbench.rundir.listing import COLUMNS, RunsTable

LONG_NAME = "digits-ddp-x2-a-rather-long-run-name-from-a-sweep-007"
CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")


def _rows() -> list[dict[str, Any]]:
    now = time.time()
    return [
        {
            "name": "char-gpt-20261128-015026",
            "status": "completed",
            "task": "char-gpt",
            "layout": "zero3 x 4, tp 2",
            "precision": "bf16",
            "steps": 2000,
            "loss": 1.23456,
            "eval": "loss 1.301, accuracy 0.6123",
            "samples/s": 12345.6,
            "started_at": now,
        },
        {
            "name": LONG_NAME,
            "status": "running",
            "task": "digits",
            "layout": "ddp x 2",
            "precision": "fp32",
            "steps": 100,
            "loss": 0.0423,
            "eval": "loss 0.05",
            "samples/s": 812.0,
            "started_at": now - 400 * 86400,  # last year's: shown with its year
        },
    ]


class _Cells(HTMLParser):
    """Each th/td's style, and each span's (title, style)."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[tuple[str, str]] = []
        self.spans: list[tuple[str | None, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag in ("th", "td"):
            self.cells.append((tag, found.get("style") or ""))
        if tag == "span":
            self.spans.append((found.get("title"), found.get("style") or ""))


def test_every_cell_of_the_runs_table_is_styled_not_to_wrap() -> None:
    parser = _Cells()
    parser.feed(RunsTable(Path("runs"), _rows())._repr_html_())
    assert len(parser.cells) == 3 * len(COLUMNS)  # a header row and two runs
    assert all("white-space:nowrap" in style for _, style in parser.cells), parser.cells


def test_a_long_run_name_ends_in_an_ellipsis_with_the_whole_name_as_its_tooltip() -> None:
    parser = _Cells()
    page = RunsTable(Path("runs"), _rows())._repr_html_()
    parser.feed(page)
    clipped = [style for title, style in parser.spans if title == LONG_NAME]
    assert clipped, f"no span titled with the whole name in {page}"
    assert "text-overflow:ellipsis" in clipped[0] and "max-width:" in clipped[0]
    assert f"data-run='{html.escape(LONG_NAME)}'" in page


def test_started_reads_month_day_and_time_this_year_and_the_date_otherwise() -> None:
    rows = _rows()
    page = RunsTable(Path("runs"), rows)._repr_html_()
    this_year, last_year = (time.localtime(r["started_at"]) for r in rows)
    full = time.strftime("%Y-%m-%d %H:%M:%S", this_year)
    assert f"<span title='{full}'>{time.strftime('%m-%d %H:%M', this_year)}</span>" in page
    assert f">{time.strftime('%Y-%m-%d', last_year)}</span>" in page


JUPYTERLAB_TABLE_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 0; }
.area { width: 850px; overflow-x: auto; }
.jp-RenderedHTMLCommon table { border-collapse: collapse; border-spacing: 0; border: none;
  font-size: 13px; table-layout: fixed; margin-left: 0; margin-bottom: 1em; margin-right: 0; }
.jp-RenderedHTMLCommon td, .jp-RenderedHTMLCommon th, .jp-RenderedHTMLCommon tr {
  vertical-align: middle; padding: 0.5em; line-height: normal; white-space: normal;
  max-width: none; border: none; text-align: right; }
"""
"""JupyterLab 4's rules for tables in an output (`white-space: normal` on cells among them), around
an output area 850 px wide: a 1280 px window with the file browser open."""


@pytest.mark.e2e
@pytest.mark.slow
def test_the_runs_table_is_one_line_a_run_in_chromium_at_1280_px(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (set WORKBENCH_CHROMIUM)")
    page_file = tmp_path / "runs.html"
    page_file.write_text(
        f"<html><head><meta charset='utf-8'><style>{JUPYTERLAB_TABLE_CSS}</style></head><body>"
        f"<div class='area jp-RenderedHTMLCommon'>"
        f"{RunsTable(Path('runs'), _rows())._repr_html_()}</div></body></html>"
    )
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"], timeout=60_000
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(page_file.as_uri(), timeout=30_000)
            heights = page.eval_on_selector_all(
                "table.wb-runs tr", "rows => rows.map(r => r.getBoundingClientRect().height)"
            )
            width = page.eval_on_selector("table.wb-runs", "t => t.getBoundingClientRect().width")
            line = page.eval_on_selector(
                "table.wb-runs td", "td => parseFloat(getComputedStyle(td).fontSize) * 1.6"
            )
            page.screenshot(path=str(tmp_path / "runs.png"))
        finally:
            browser.close()
    # a row of one line is the line plus its padding; a wrapped one is a line more
    assert len(heights) == 3 and max(heights) < 2 * line, (heights, line)
    assert width <= 850, f"the table is {width} px wide, more than the output area's 850"
