"""Reports of a regression run: report.html (self-contained), report.md, results.json, JUnit XML,
curve plots."""

from __future__ import annotations

import datetime
import html
import io
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from workbench.regress.case_report import (
    case_json,
    current_text,
    fmt_value,
    html_section,
    md_cell,
    md_section,
)
from workbench.regress.judging import (
    ERROR,
    FAILED,
    NEW,
    PASSED,
    SKIPPED,
    UPDATED,
    CaseResult,
    exit_code,
)

_XML_ILLEGAL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
_STATUS_ORDER = (ERROR, FAILED, NEW, UPDATED, PASSED, SKIPPED)

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.status{padding:1px 8px;border-radius:8px;font-size:90%;color:#fff;white-space:nowrap}
.status.passed,.status.pass{background:#1b5e20}
.status.passed::before,.status.pass::before{content:"\\2713  "}
.status.failed,.status.fail,.status.missing{background:#b71c1c}
.status.failed::before,.status.fail::before,.status.missing::before{content:"\\2717  "}
.status.error{background:#6a1b9a}.status.error::before{content:"!  "}
.status.new,.status.updated{background:#0d47a1}.status.skipped,.status.info{background:#545454}
tr.fail td,tr.missing td{background:#fdecea}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:85%}img{max-width:100%}
"""


def plot_curves(result: CaseResult) -> bytes | None:
    """PNG of each recorded curve (solid) over the baseline's (dashed), or None when the case
    recorded none."""
    if not result.curves and not result.baseline_curves:
        return None
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state

    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    for i, name in enumerate(sorted(set(result.curves) | set(result.baseline_curves))):
        for curves, style, label in (
            (result.baseline_curves, "--", "baseline"),
            (result.curves, "-", "current"),
        ):
            pts = curves.get(name)
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    color=f"C{i}",
                    label=f"{name} ({label})",
                )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(result.case.id)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def write_report(results: Sequence[CaseResult], out: Path, *, device_class: str) -> Path:
    """report.html, report.md and results.json in `out`, and a curves.png per case; returns
    report.html's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now().isoformat(timespec="seconds")
    counts = ", ".join(
        f"{n} {s}" for s in _STATUS_ORDER if (n := sum(r.status == s for r in results))
    )
    code = exit_code(results)
    title = f"workbench regress on {device_class}, {when}"
    curves = [_write_curves(r, out) for r in results]
    report = _write_html(results, curves, out, title, f"{counts}; exit code {code}")
    _write_md(results, curves, out, title, f"{counts}; exit code {code}")
    _write_json(results, out, device_class, when, code)
    return report


def _write_curves(r: CaseResult, out: Path) -> tuple[bytes | None, Path | None]:
    """The case's curves plot as PNG bytes, written to out/cases/<id>/curves.png too, and that
    path (both None when the case recorded no curve)."""
    png = plot_curves(r)
    if png is None:
        return None, None
    png_path = out / "cases" / r.case.id / "curves.png"
    png_path.parent.mkdir(parents=True, exist_ok=True)
    png_path.write_bytes(png)
    return png, png_path


def _detail(r: CaseResult) -> str:
    """The summary table's detail of a case: its error's first line, the metrics that failed, or
    its first note."""
    if r.error:
        return r.error.message.splitlines()[0]
    return ", ".join(m.name for m in r.failed_metrics) or (r.notes[0] if r.notes else "")


def _write_html(
    results: Sequence[CaseResult],
    curves: Sequence[tuple[bytes | None, Path | None]],
    out: Path,
    title: str,
    headline: str,
) -> Path:
    """report.html: the summary table with a link to each case's section below it."""
    e = html.escape
    summary_rows = [
        f'<tr><td><a href="#{e(r.case.id)}">{e(r.case.id)}</a></td>'
        f'<td><span class="status {r.status}">{r.status}</span></td>'
        f'<td class="num">{r.duration_s:.1f} s</td><td>{e(_detail(r))}</td></tr>'
        for r in results
    ]
    sections = [html_section(r, out, png) for r, (png, _) in zip(results, curves, strict=True)]
    page = (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{e(title)}</title>'
        f"<style>{_CSS}</style>"
        f"</head><body>\n<h1>{e(title)}</h1>\n<p>{e(headline)}</p>\n"
        "<table><tr><th>case</th><th>status</th><th>time</th><th>detail</th></tr>"
        f"{''.join(summary_rows)}</table>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    report = out / "report.html"
    report.write_text(page, encoding="utf-8")
    return report


def _write_md(
    results: Sequence[CaseResult],
    curves: Sequence[tuple[bytes | None, Path | None]],
    out: Path,
    title: str,
    headline: str,
) -> None:
    """report.md: the same summary and sections as report.html, the plots linked."""
    md = [
        f"# {title}",
        "",
        headline,
        "",
        "| case | status | time | detail |",
        "|---|---|---:|---|",
        *(
            f"| {r.case.id} | {r.status} | {r.duration_s:.1f} s | {md_cell(_detail(r))} |"
            for r in results
        ),
        "",
        *(md_section(r, out, png_path) for r, (_, png_path) in zip(results, curves, strict=True)),
    ]
    (out / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")


def _write_json(
    results: Sequence[CaseResult], out: Path, device_class: str, when: str, code: int
) -> None:
    """results.json: every case's verdicts and figures, for tools."""
    (out / "results.json").write_text(
        json.dumps(
            {
                "device_class": device_class,
                "time": when,
                "exit_code": code,
                "cases": [case_json(r) for r in results],
            },
            indent=2,
            default=str,
        )
        + "\n",
        encoding="utf-8",
    )


def _xml_text(text: str) -> str:
    return _XML_ILLEGAL.sub("", text)


def write_junit(results: Sequence[CaseResult], path: Path) -> None:
    """JUnit XML: a testsuite per suite, <failure> for regressions, <error> for cases that could not
    run."""
    root = ET.Element("testsuites", name="workbench regress")
    suites: dict[str, ET.Element] = {}
    for r in results:
        if r.case.suite not in suites:
            suites[r.case.suite] = ET.SubElement(root, "testsuite", name=r.case.suite)
        tc = ET.SubElement(
            suites[r.case.suite],
            "testcase",
            classname=f"regress.{r.case.suite}",
            name=r.case.name,
            time=f"{r.duration_s:.3f}",
        )
        if r.status == FAILED:
            bad = r.failed_metrics
            el = ET.SubElement(
                tc,
                "failure",
                type="regression",
                message=f"{len(bad)} metric(s) regressed: {', '.join(m.name for m in bad)}",
            )
            el.text = "\n".join(
                f"{m.name}: baseline {fmt_value(m.baseline, m.unit)}, current {current_text(m)}; "
                f"{m.rule.mode if m.rule else '-'} ({m.rule_source}): {m.reason}"
                for m in bad
            )
        elif r.status == ERROR and r.error is not None:
            el = ET.SubElement(
                tc,
                "error",
                type=r.error.ename or r.error.kind,
                message=_xml_text(f"{r.error.kind}: {r.error.message}"),
            )
            el.text = _xml_text(
                "\n\n".join(t for t in (r.error.cell_source, r.error.traceback) if t)
            )
        elif r.status == SKIPPED:
            ET.SubElement(tc, "skipped", message=r.notes[0] if r.notes else "skipped")
        out_lines = [f"executed: {p}" for p in r.notebooks] + r.notes
        if out_lines:
            ET.SubElement(tc, "system-out").text = _xml_text("\n".join(out_lines))
    for name, suite in suites.items():
        cases = [r for r in results if r.case.suite == name]
        suite.set("tests", str(len(cases)))
        suite.set("failures", str(sum(r.status == FAILED for r in cases)))
        suite.set("errors", str(sum(r.status == ERROR for r in cases)))
        suite.set("skipped", str(sum(r.status == SKIPPED for r in cases)))
        suite.set("time", f"{sum(r.duration_s for r in cases):.3f}")
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(s.get(key)) for s in suites.values())))
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
