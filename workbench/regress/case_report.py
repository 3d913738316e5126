"""One case's part of a regression report: its section in report.html and report.md (metrics
table, error, notes, curves plot) and its entry in results.json."""

from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path
from typing import Any

from workbench.regress.judging import CaseResult, MetricResult
from workbench.utils.units import fmt_bytes


def fmt_value(value: float | None, unit: str | None = None) -> str:
    """A metric's value for the tables: bytes in MiB, floats to 4 significant digits, '-' for
    none."""
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


def current_text(m: MetricResult) -> str:
    """The current value, followed by each repeat's when the case ran more than once."""
    text = fmt_value(m.current, m.unit)
    if len(m.values) > 1:
        text += f" (repeats: {', '.join(fmt_value(v, m.unit) for v in m.values)})"
    return text


def _rows(m: MetricResult) -> list[str]:
    """metric, baseline, current, delta, tolerance, rule, verdict."""
    return [
        m.name,
        fmt_value(m.baseline, m.unit),
        current_text(m),
        _delta(m),
        m.rule.as_text() if m.rule else "-",
        f"{m.rule.mode if m.rule else '-'} ({m.rule_source})",
        f"{m.verdict}: {m.reason}",
    ]


def _rel(path: Path, out: Path) -> str:
    return Path(os.path.relpath(path, out)).as_posix()


def html_section(r: CaseResult, out: Path, png: bytes | None) -> str:
    """The case's section of report.html, its curves plot (`png`) embedded."""
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


def md_cell(text: str) -> str:
    """`text` made safe inside one cell of a Markdown table."""
    return text.replace("|", "\\|").replace("\n", " ")


def md_section(r: CaseResult, out: Path, png_path: Path | None) -> str:
    """The case's section of report.md, its curves plot linked."""
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
        lines += ["| " + " | ".join(md_cell(c) for c in _rows(m)) + " |" for m in r.metrics]
        lines.append("")
    if png_path is not None:
        lines += [f"![loss curves]({_rel(png_path, out)})", ""]
    return "\n".join(lines)


def case_json(r: CaseResult) -> dict[str, Any]:
    """The case's entry in results.json."""
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
