"""The benchmarks page's tables, rendered at build time from the result files under benchmarks/results/.

Each `workbench bench NAME` result kept in benchmarks/results/NAME/ starts with a `measured_on` block
(date, CPU, cores, GPUs, device class, versions: workbench/commands/bench/results.py). In a page,
`<!-- generated: bench-results NAME -->` becomes, for each device class, a table of the newest result of that
class, headed by its machine and date; older results stay in their files. `<!-- generated: bench-results-others
-->` does the same for every result folder the page doesn't name, so new benches show up on their own.

Results written before `measured_on` existed are shown too: their date comes from the file name
(YYYY-MM-DD...) when it has one, their device class from the result's `device` field, else "unknown".
"""

from __future__ import annotations

import json
import logging
import re
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ONE = re.compile(r"<!-- generated: bench-results ([\w.-]+) -->")
OTHERS = "<!-- generated: bench-results-others -->"
log = logging.getLogger("mkdocs.hooks.benchmarks")


def on_page_markdown(markdown, page, config, files):
    if not ONE.search(markdown) and OTHERS not in markdown:
        return markdown
    named = set(ONE.findall(markdown))
    markdown = ONE.sub(lambda m: bench_section(m.group(1)), markdown)
    others = (
        sorted(d.name for d in RESULTS.iterdir() if d.is_dir() and d.name not in named)
        if RESULTS.is_dir()
        else []
    )
    text = "\n".join(f"### `{name}`\n\n{bench_section(name)}" for name in others) or "None yet.\n"
    return markdown.replace(OTHERS, text)


def bench_section(bench: str) -> str:
    """The newest result per device class of one bench, each as a table under its machine and date."""
    results = [r for r in map(_load, sorted((RESULTS / bench).glob("*.json"))) if r is not None]
    if not results:
        return f"*No result in `benchmarks/results/{bench}/` yet.*\n"
    newest: dict[str, dict[str, Any]] = {}
    for result in sorted(results, key=lambda r: r["_date"]):
        newest[result["_class"]] = result  # a later one of the same class replaces it
    return "\n".join(
        _result_table(r, len([x for x in results if x["_class"] == c]))
        for c, r in sorted(newest.items())
    )


def _load(path: Path) -> dict[str, Any] | None:
    """The result with its date, device class and file under `_` keys; None (and a warning, which fails a
    strict build) for a file that isn't a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        data = e
    if not isinstance(data, dict):
        log.warning("benchmarks: %s is not a JSON object of results (%s)", path, data)
        return None
    stamp = data.get("measured_on") or {}
    name_date = re.match(r"\d{4}-\d{2}-\d{2}", path.name)
    data["_date"] = str(stamp.get("date") or (name_date.group(0) if name_date else ""))
    data["_class"] = str(stamp.get("device_class") or data.get("device") or "unknown")
    data["_file"] = path.relative_to(RESULTS.parent.parent).as_posix()
    return data


def _machine(result: dict[str, Any]) -> str:
    stamp = result.get("measured_on")
    if not stamp:
        return "machine not recorded (written before results carried `measured_on`)"
    gpus = stamp.get("gpus") or []
    parts = [
        f"{stamp.get('cpu', '?')}, {stamp.get('cores', '?')} cores",
        f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU",
        f"torch {stamp['torch']}" if stamp.get("torch") else "",
        f"CUDA {stamp['cuda']}" if stamp.get("cuda") else "",
        f"load {stamp['load_average_1min']}" if stamp.get("load_average_1min") is not None else "",
    ]
    return ", ".join(p for p in parts if p)


def _result_table(result: dict[str, Any], kept: int) -> str:
    date = f"measured {result['_date'][:10]}" if result["_date"] else "date not recorded"
    head = (
        f"**{result['_class']}**: {_machine(result)}; {date} "
        f"(`{result['_file']}`{f', newest of {kept}' if kept > 1 else ''}).\n"
    )
    plain = {
        k: v
        for k, v in result.items()
        if not k.startswith("_") and k not in ("measured_on", "rows")
    }
    rows = result.get("rows")
    if not (isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows)):
        rows = [plain]  # no rows: the result's own figures are the one row
        plain = {}
    flat = [_flatten(r) for r in rows]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(r.get(c, "") for c in columns) + " |" for r in flat]
    summary = _flatten(plain)
    tail = "; ".join(f"{k}: {v}" for k, v in summary.items())
    return head + "\n" + "\n".join(lines) + "\n" + (f"\n{tail}\n" if tail else "")


def _flatten(row: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """One cell per figure: nested mappings as 'key: sub', lists of numbers as their median."""
    out: dict[str, str] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if value == [] or value == {}:
            continue  # nothing measured (e.g. a way in that has no import time)
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}: "))
        elif isinstance(value, list) and value and all(_number(v) for v in value):
            out[f"{name} (median)"] = _fmt(statistics.median(value))
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            out[name] = f"{len(value)} entries"
        else:
            out[name] = _fmt(value)
    return {k.replace("|", "\\|"): v.replace("|", "\\|") for k, v in out.items()}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, list):
        return ", ".join(map(_fmt, value))
    if value is None:
        return ""
    return str(value)
