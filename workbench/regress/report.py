"""Reports of a regression run: report.html (self-contained), report.md, results.json, JUnit XML,
curve plots."""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.regress.judging import (
    ERROR,
    FAILED,
    NEW,
    PASSED,
    SKIPPED,
    UPDATED,
    CaseResult,
    MetricResult,
    exit_code,
)
from workbench.utils.units import fmt_bytes

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


def _fmt(value: float | None, unit: str | None = None) -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        return fmt_bytes(value, "MiB", ".1f")
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return f"{text} {unit}" if unit else text


def _delta(m: MetricResult) -> str:
    d = m.delta
    if d is None:
        return "-"
    pct = f" ({d / abs(m.baseline):+.1%})" if m.baseline else ""
    return (fmt_bytes(d, "MiB", "+.1f") if m.unit == "bytes" else f"{d:+.4g}") + pct


def _current(m: MetricResult) -> str:
    text = _fmt(m.current, m.unit)
    if len(m.values) > 1:
        text += f" (repeats: {', '.join(_fmt(v, m.unit) for v in m.values)})"
    return text


def _rows(m: MetricResult) -> list[str]:
    """metric, baseline, current, delta, tolerance, rule, verdict."""
    return [
        m.name,
        _fmt(m.baseline, m.unit),
        _current(m),
        _delta(m),
        m.rule.describe() if m.rule else "-",
        f"{m.rule.mode if m.rule else '-'} ({m.rule_source})",
        f"{m.verdict}: {m.reason}",
    ]


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


def _rel(path: Path, out: Path) -> str:
    return Path(os.path.relpath(path, out)).as_posix()


def _html_case(r: CaseResult, out: Path, png: bytes | None) -> str:
    e = html.escape
    parts = [
        f'<h2 id="{e(r.case.id)}">{e(r.case.id)} <span class="status '
        f'{r.status}">{r.status}</span></h2>'
    ]
    links = (
        ", ".join(f'<a href="{e(_rel(p, out))}">{e(_rel(p, out))}</a>' for p in r.notebooks) or "-"
    )
    parts.append(
        f"<p>notebook <code>{e(str(r.case.notebook))}</code>; executed: {links}; "
        f"{r.duration_s:.1f} s<br>parameters "
        f"<code>{e(json.dumps(r.parameters, default=str))}</code><br>baseline "
        f"<code>{e(str(r.baseline_path))}</code></p>"
    )
    if r.notes:
        parts.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in r.notes) + "</ul>")
    if r.error is not None:
        err = r.error
        parts.append(f"<div><h3>{e(err.kind)}</h3><p><b>{e(err.message)}</b></p>")
        if err.cell_source:
            parts.append(f"<p>failing cell:</p><pre>{e(err.cell_source)}</pre>")
        if err.traceback:
            parts.append(f"<p>traceback:</p><pre>{e(err.traceback)}</pre>")
        parts.append("</div>")
    if r.metrics:
        head = "".join(
            f"<th>{h}</th>"
            for h in ("metric", "baseline", "current", "delta", "tolerance", "rule", "verdict")
        )
        rows = []
        for m in r.metrics:
            cells = _rows(m)
            tds = (
                [f"<td>{e(cells[0])}</td>"]
                + [f'<td class="num">{e(c)}</td>' for c in cells[1:4]]
                + [f"<td>{e(c)}</td>" for c in cells[4:6]]
                + [f'<td><span class="status {m.verdict}">{m.verdict}</span> {e(m.reason)}</td>']
            )
            rows.append(f'<tr class="{m.verdict}">{"".join(tds)}</tr>')
        parts.append(f"<table><tr>{head}</tr>{''.join(rows)}</table>")
    if png is not None:
        parts.append(
            f'<img alt="loss curves of {e(r.case.id)}" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        )
    return "\n".join(parts)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_case(r: CaseResult, out: Path, png_path: Path | None) -> str:
    lines = [f"## {r.case.id}: {r.status}", ""]
    links = ", ".join(f"[{_rel(p, out)}]({_rel(p, out)})" for p in r.notebooks) or "-"
    lines += [
        f"- notebook: `{r.case.notebook}`; executed: {links}; {r.duration_s:.1f} s",
        f"- parameters: `{json.dumps(r.parameters, default=str)}`",
        f"- baseline: `{r.baseline_path}`",
    ]
    lines += [f"- {n}" for n in r.notes]
    lines.append("")
    if r.error is not None:
        lines += [f"**{r.error.kind}**: {r.error.message}", ""]
        if r.error.cell_source:
            lines += ["Failing cell:", "", "```python", r.error.cell_source, "```", ""]
        if r.error.traceback:
            lines += ["```", r.error.traceback, "```", ""]
    if r.metrics:
        lines += [
            "| metric | baseline | current | delta | tolerance | rule | verdict |",
            "|---|---:|---:|---:|---|---|---|",
        ]
        lines += ["| " + " | ".join(_md_cell(c) for c in _rows(m)) + " |" for m in r.metrics]
        lines.append("")
    if png_path is not None:
        lines += [f"![loss curves]({_rel(png_path, out)})", ""]
    return "\n".join(lines)


def _result_json(r: CaseResult) -> dict[str, Any]:
    return {
        "case": r.case.id,
        "status": r.status,
        "notebook": str(r.case.notebook),
        "parameters": r.parameters,
        "duration_s": r.duration_s,
        "executed": [str(p) for p in r.notebooks],
        "notes": r.notes,
        "baseline": str(r.baseline_path),
        "error": None if r.error is None else vars(r.error),
        "metrics": [
            {
                "name": m.name,
                "verdict": m.verdict,
                "reason": m.reason,
                "current": m.current,
                "baseline": m.baseline,
                "values": m.values,
                "unit": m.unit,
                "rule": None if m.rule is None else vars(m.rule),
                "rule_source": m.rule_source,
            }
            for m in r.metrics
        ],
    }


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
    e = html.escape
    summary_rows, md_summary, sections, md_sections = [], [], [], []
    for r in results:
        png = plot_curves(r)
        png_path = None
        if png is not None:
            png_path = out / "cases" / r.case.id / "curves.png"
            png_path.parent.mkdir(parents=True, exist_ok=True)
            png_path.write_bytes(png)
        detail = (
            r.error.message.splitlines()[0]
            if r.error
            else ", ".join(m.name for m in r.failed_metrics) or (r.notes[0] if r.notes else "")
        )
        summary_rows.append(
            f'<tr><td><a href="#{e(r.case.id)}">{e(r.case.id)}</a></td>'
            f'<td><span class="status {r.status}">{r.status}</span></td>'
            f'<td class="num">{r.duration_s:.1f} s</td><td>{e(detail)}</td></tr>'
        )
        md_summary.append(
            f"| {r.case.id} | {r.status} | {r.duration_s:.1f} s | {_md_cell(detail)} |"
        )
        sections.append(_html_case(r, out, png))
        md_sections.append(_md_case(r, out, png_path))
    title = f"workbench regress on {device_class}, {when}"
    page = (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{e(title)}</title>'
        f"<style>{_CSS}</style>"
        f"</head><body>\n<h1>{e(title)}</h1>\n<p>{e(counts)}; exit code {code}</p>\n"
        "<table><tr><th>case</th><th>status</th><th>time</th><th>detail</th></tr>"
        f"{''.join(summary_rows)}</table>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    report = out / "report.html"
    report.write_text(page, encoding="utf-8")
    md = [
        f"# {title}",
        "",
        f"{counts}; exit code {code}",
        "",
        "| case | status | time | detail |",
        "|---|---|---:|---|",
        *md_summary,
        "",
        *md_sections,
    ]
    (out / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    (out / "results.json").write_text(
        json.dumps(
            {
                "device_class": device_class,
                "time": when,
                "exit_code": code,
                "cases": [_result_json(r) for r in results],
            },
            indent=2,
            default=str,
        )
        + "\n",
        encoding="utf-8",
    )
    return report


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
                f"{m.name}: baseline {_fmt(m.baseline, m.unit)}, current {_current(m)}; "
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
