"""Regression runs: papermill executes notebooks headless, and what they recorded is compared to baselines.

A suite is data, a YAML file (paths relative to it):

    name: smoke                      # default: the file's stem; case ids are '<name>.<case name>'
    baselines: baselines             # default: baselines/ beside the suite file
    defaults:                        # any case key but notebook/name/description, for every case
      profile: smoke
      tolerances: {"*.samples_per_s": {mode: higher_is_better, rel: 0.5}}
    cases:
      - notebook: ../notebooks/01_quickstart.ipynb
        name: quickstart             # default: the notebook's stem
        parameters: {max_steps: 30}  # papermill parameters; `-p NAME VALUE` on the command line wins
        profile: smoke               # or a list; `--profile` runs only the cases that have it
        timeout_s: 600               # all cells together (kernel start not counted)
        needs_gpu: false             # without CUDA the case is skipped, not failed
        repeats: 1                   # run N times and compare the median (noisy timings)
        tolerances:                  # metric name or glob -> rule; beats the notebook's own tolerance
          "*.final_loss": {mode: abs, abs: 0.05}
          "*.wall_time_s": info

Baselines live in <baselines>/<device class>/<case id>.json ('cpu', 'cuda-H100', ...) and are written by
`--update-baselines`. A notebook target (.ipynb) is one case with default settings, baselines beside it.
"""

from __future__ import annotations

import datetime
import difflib
import fnmatch
import json
import logging
import math
import re
import shutil
import statistics
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .recording import RecordedMetric, Records, decode_value, encode_value, read_records

log = logging.getLogger("workbench")

KERNEL = "python3"
DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_REL = 0.05
MODES = ("abs", "rel", "higher_is_better", "lower_is_better", "exact", "info")
_RULE_KEYS = ("mode", "abs", "rel")
_SUITE_KEYS = ("name", "description", "baselines", "defaults", "cases")
_DEFAULT_KEYS = ("parameters", "profile", "timeout_s", "needs_gpu", "repeats", "tolerances")
_CASE_KEYS = ("notebook", "name", "description", *_DEFAULT_KEYS)
_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")

# Case statuses, worst first; exit code 2 for 'error', 1 for 'failed'.
ERROR, FAILED, NEW, PASSED, UPDATED, SKIPPED = "error", "failed", "new", "passed", "updated", "skipped"


# ---- comparison rules -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """How a metric is judged against its baseline. abs/rel are allowances; directional modes take the larger."""

    mode: str
    abs: float | None = None
    rel: float | None = None

    def allowance(self, baseline: float) -> float:
        return max(self.abs or 0.0, (self.rel or 0.0) * abs(baseline))

    def describe(self) -> str:
        amounts = ([f"{self.abs:g}"] if self.abs is not None else []) + \
                  ([f"{self.rel * 100:g}%"] if self.rel is not None else [])
        amount = amounts[0] if len(amounts) == 1 else f"max({', '.join(amounts)})"
        return {"abs": f"within ±{amount}", "rel": f"within ±{amount} of baseline",
                "higher_is_better": f"drop <= {amount}", "lower_is_better": f"rise <= {amount}",
                "exact": "equal", "info": "not compared"}[self.mode]

    def check(self, current: float, baseline: float, unit: str | None = None) -> tuple[str, str]:
        """('pass' | 'fail' | 'info', reason with the numbers)."""
        def num(v: float) -> str:
            return f"{v / 2**20:.4g} MiB" if unit == "bytes" else f"{v:.4g}"

        if self.mode == "info":
            return "info", "reported only"
        if not math.isfinite(baseline):
            return "fail", f"baseline is {baseline}; write one from a healthy run with --update-baselines"
        if not math.isfinite(current):
            return "fail", f"current is {current} (baseline {num(baseline)}): the run diverged"
        if self.mode == "exact":
            return ("pass", "equal") if current == baseline else ("fail", f"{num(current)} != {num(baseline)}")
        delta = current - baseline
        allowed = self.allowance(baseline)
        # Float noise must not fail a change that sits exactly on the tolerance (1.1 - 1.0 > 0.1 in binary).
        slack = 1e-9 * max(abs(baseline), abs(current), allowed) + 1e-12
        pct = f" ({delta / abs(baseline):+.1%})" if baseline else ""
        if delta == 0:
            return "pass", "unchanged"
        if self.mode in ("abs", "rel"):
            moved, what = abs(delta), "changed"
        else:
            better = delta > 0 if self.mode == "higher_is_better" else delta < 0
            if better:
                return "pass", f"{'rose' if delta > 0 else 'fell'} {num(abs(delta))}{pct}: better, never fails"
            moved, what = abs(delta), "drop" if self.mode == "higher_is_better" else "rise"
        if moved <= allowed + slack:
            return "pass", f"{what} {num(moved)}{pct} <= allowed {num(allowed)}"
        return "fail", f"{what} {num(moved)}{pct} > allowed {num(allowed)}"


def default_rule(direction: str | None) -> Rule:
    mode = {"higher": "higher_is_better", "lower": "lower_is_better"}.get(direction or "", "rel")
    return Rule(mode, rel=DEFAULT_REL)


def _suggest(word: str, allowed: Sequence[str]) -> str:
    close = [a for a in allowed if word.startswith(a) or a.startswith(word)] or \
        difflib.get_close_matches(word, allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_rule(spec: Mapping[str, Any] | str | None, direction: str | None = None, *,
               where: str = "tolerance") -> Rule:
    """A Rule from a tolerance spec: {'abs': x} | {'rel': x} | {'mode': m, 'abs'/'rel': x} | 'exact' | 'info'.

    Without `mode`, a direction ('higher'/'lower') makes the check one-sided; otherwise abs or rel is two-sided.
    """
    if spec is None:
        return default_rule(direction)
    if isinstance(spec, str):
        spec = {"mode": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}={spec!r}: use a mapping such as {{abs: 0.05}} or "
                         "{mode: higher_is_better, rel: 0.5}, or one of 'exact', 'info'")
    for key in spec:
        if key not in _RULE_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}{_suggest(str(key), _RULE_KEYS)}; "
                             f"allowed: {', '.join(_RULE_KEYS)}")
    amounts: dict[str, float | None] = {}
    for key in ("abs", "rel"):
        value = spec.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{where}: {key}={value!r}: must be a number >= 0 (rel is a fraction: 0.05 is 5%)")
        amounts[key] = None if value is None else float(value)
    a, r = amounts["abs"], amounts["rel"]
    mode = spec.get("mode")
    if mode is None:
        if direction in ("higher", "lower"):
            mode = f"{direction}_is_better"
        elif a is not None and r is not None:
            raise ValueError(f"{where}: both abs and rel but no mode: set mode (abs or rel for a two-sided check "
                             "with one of them, higher_is_better/lower_is_better to allow the larger)")
        elif a is not None or r is not None:
            mode = "abs" if a is not None else "rel"
        else:
            raise ValueError(f"{where}={dict(spec)!r}: give abs or rel (e.g. {{rel: 0.05}}), or a mode")
    if mode not in MODES:
        raise ValueError(f"{where}: mode={mode!r}{_suggest(str(mode), MODES)}; choose one of {', '.join(MODES)}")
    if (mode == "abs" and (a is None or r is not None)) or (mode == "rel" and (r is None or a is not None)):
        raise ValueError(f"{where}: mode={mode!r} takes exactly {mode!r} (a two-sided check with one allowance), "
                         f"e.g. {{mode: {mode}, {mode}: 0.05}}")
    if mode.endswith("_is_better") and a is None and r is None:
        raise ValueError(f"{where}: mode={mode!r} needs abs and/or rel: how much worse is still fine, "
                         f"e.g. {{mode: {mode}, rel: 0.2}}")
    if mode in ("exact", "info") and (a is not None or r is not None):
        raise ValueError(f"{where}: mode={mode!r} takes no abs/rel")
    return Rule(mode, a, r)


def median(values: Sequence[float]) -> float:
    """The median of repeats, the way asv and pytest-benchmark summarise noisy timings. A NaN in any repeat is
    returned as NaN: one diverged repeat is a regression, not an outlier to hide."""
    if any(isinstance(v, float) and math.isnan(v) for v in values):
        return math.nan
    return statistics.median(values)


# ---- suites ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One notebook to execute and judge, with everything from its suite resolved."""

    id: str
    suite: str
    name: str
    notebook: Path
    baselines: Path
    parameters: dict[str, Any] = field(default_factory=dict)
    profiles: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    needs_gpu: bool = False
    repeats: int = 1
    tolerances: tuple[dict[str, Any], ...] = ()
    """Case-level then suite-level tables of metric name or glob -> rule spec; the first match decides."""
    source: str = ""

    def rule_for(self, name: str, direction: str | None, notebook_tolerance: Any = None) -> tuple[Rule, str]:
        """The rule for metric `name` and where it came from: the suite, the notebook, or the default."""
        for table in self.tolerances:
            if name in table:
                return parse_rule(table[name], direction, where=f"{self.source} tolerances[{name!r}]"), \
                    f"suite '{name}'"
            for pattern, spec in table.items():
                if fnmatch.fnmatchcase(name, pattern):
                    return parse_rule(spec, direction, where=f"{self.source} tolerances[{pattern!r}]"), \
                        f"suite '{pattern}'"
        if notebook_tolerance is not None:
            return parse_rule(notebook_tolerance, direction, where=f"notebook tolerance of {name!r}"), "notebook"
        return default_rule(direction), "default"


def _reject_unknown(data: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in data:
        if key not in allowed:
            raise ValueError(f"{where}: unknown key {key!r}{_suggest(str(key), allowed)}; "
                             f"allowed: {', '.join(allowed)}")


def _check_fields(data: Mapping[str, Any], where: str) -> None:
    """Types of the case/default fields, each error naming the field and a value that would work."""
    if "parameters" in data and not (isinstance(data["parameters"], Mapping)
                                     and all(isinstance(k, str) for k in data["parameters"])):
        raise ValueError(f"{where}: parameters={data['parameters']!r}: use a mapping, e.g. {{max_steps: 30}}")
    prof = data.get("profile")
    if prof is not None and not (isinstance(prof, str) or (isinstance(prof, list)
                                                           and all(isinstance(p, str) for p in prof))):
        raise ValueError(f"{where}: profile={prof!r}: use a name or a list of names, e.g. smoke or [smoke, full]")
    t = data.get("timeout_s")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
        raise ValueError(f"{where}: timeout_s={t!r}: use seconds > 0, e.g. 600")
    if "needs_gpu" in data and not isinstance(data["needs_gpu"], bool):
        raise ValueError(f"{where}: needs_gpu={data['needs_gpu']!r}: use true or false")
    n = data.get("repeats")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{where}: repeats={n!r}: use a whole number >= 1 (e.g. 3 for noisy timings)")
    tol = data.get("tolerances")
    if tol is not None:
        if not isinstance(tol, Mapping):
            raise ValueError(f"{where}: tolerances={tol!r}: use a mapping of metric name (or glob) to rule, "
                             "e.g. {'*.final_loss': {mode: abs, abs: 0.05}}")
        for metric, spec in tol.items():
            # Direction is only known once the notebook runs; 'higher' accepts every spec that some metric could use.
            parse_rule(spec, "higher", where=f"{where}: tolerances[{metric!r}]")
            if isinstance(spec, Mapping) and "mode" not in spec and spec.get("abs") is not None \
                    and spec.get("rel") is not None:
                raise ValueError(f"{where}: tolerances[{metric!r}] has abs and rel but no mode: set mode, "
                                 "e.g. {mode: lower_is_better, abs: 0.01, rel: 0.05}")


def load_suite(path: Path, baselines: Path | None = None) -> list[Case]:
    """The cases of a suite file, validated (unknown keys, types, notebooks that exist) before anything runs."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, Mapping) or not data.get("cases"):
        raise ValueError(f"{path}: a suite is a mapping with a non-empty 'cases:' list of {{notebook: ...}}")
    _reject_unknown(data, _SUITE_KEYS, str(path))
    suite = data.get("name", path.stem)
    if not isinstance(suite, str) or not _ID.match(suite):
        raise ValueError(f"{path}: name={suite!r}: use letters, digits, '_', '.', '-'")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise ValueError(f"{path}: defaults={defaults!r}: use a mapping of case keys, e.g. {{profile: smoke}}")
    _reject_unknown(defaults, _DEFAULT_KEYS, f"{path}: defaults")
    _check_fields(defaults, f"{path}: defaults")
    if not isinstance(data["cases"], list):
        raise ValueError(f"{path}: cases: use a list, each item a mapping with 'notebook:'")
    root = baselines if baselines is not None else path.parent / str(data.get("baselines", "baselines"))
    cases = []
    for i, raw in enumerate(data["cases"]):
        where = f"{path}: cases[{i}]"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: use a mapping such as {{notebook: ../notebooks/x.ipynb}}")
        _reject_unknown(raw, _CASE_KEYS, where)
        if "notebook" not in raw:
            raise ValueError(f"{where}: missing 'notebook': the .ipynb to run, relative to the suite file")
        notebook = (path.parent / str(raw["notebook"])).resolve()
        if notebook.suffix != ".ipynb" or not notebook.is_file():
            raise ValueError(f"{where}: notebook {raw['notebook']!r} not found (looked for {notebook}); "
                             "paths are relative to the suite file")
        _check_fields(raw, where)
        name = raw.get("name", notebook.stem)
        if not isinstance(name, str) or not _ID.match(name):
            raise ValueError(f"{where}: name={name!r}: use letters, digits, '_', '.', '-' (it names files)")
        merged = {**defaults, **raw}
        profile = merged.get("profile")
        cases.append(Case(
            id=f"{suite}.{name}", suite=suite, name=name, notebook=notebook, baselines=root,
            parameters={**defaults.get("parameters", {}), **raw.get("parameters", {})},
            profiles=tuple([profile] if isinstance(profile, str) else profile or ()),
            timeout_s=float(merged.get("timeout_s", DEFAULT_TIMEOUT_S)), needs_gpu=merged.get("needs_gpu", False),
            repeats=merged.get("repeats", 1),
            tolerances=tuple(t for t in (raw.get("tolerances"), defaults.get("tolerances")) if t),
            source=where))
    return cases


def load_targets(targets: Sequence[Path], baselines: Path | None = None) -> list[Case]:
    """Cases of every target: suites (.yaml/.yml) and single notebooks (.ipynb). Ids must be unique."""
    if not targets:
        raise ValueError("no targets: name notebooks (.ipynb) or suite files (.yaml), e.g. regress/smoke.yaml")
    cases: list[Case] = []
    baselines = None if baselines is None else Path(baselines).resolve()
    for target in map(Path, targets):
        if not target.is_file():
            raise ValueError(f"{target}: no such file; name a notebook (.ipynb) or a suite (.yaml)")
        if target.suffix in (".yaml", ".yml"):
            cases += load_suite(target, baselines)
        elif target.suffix == ".ipynb":
            nb = target.resolve()
            cases.append(Case(id=nb.stem, suite="notebooks", name=nb.stem, notebook=nb,
                              baselines=baselines if baselines is not None else nb.parent / "baselines",
                              source=str(target)))
        else:
            raise ValueError(f"{target}: unknown kind of target; name a notebook (.ipynb) or a suite (.yaml)")
    seen: dict[str, Case] = {}
    for case in cases:
        if case.id in seen:
            raise ValueError(f"case id {case.id!r} appears twice ({seen[case.id].source} and {case.source}); "
                             "give one a different 'name:'")
        seen[case.id] = case
    return cases


def select_profile(cases: list[Case], profile: str | None) -> list[Case]:
    """Cases of `profile` (bare notebook targets have none and always run); all cases when profile is None."""
    if profile is None:
        return cases
    chosen = [c for c in cases if profile in c.profiles or c.suite == "notebooks"]
    if not chosen:
        known = sorted({p for c in cases for p in c.profiles})
        raise ValueError(f"--profile {profile!r}: no case has it; profiles in these suites: "
                         f"{', '.join(known) or 'none'}")
    return chosen


def parse_parameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`-p NAME VALUE` strings to Python values, like papermill's CLI (YAML), '1e-3' read as a number too."""
    values: dict[str, Any] = {}
    for name, text in raw.items():
        if not str(name).isidentifier():
            raise ValueError(f"-p {name} {text}: parameter names are Python identifiers, e.g. -p max_steps 50")
        if not isinstance(text, str):
            values[name] = text
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 as a string; papermill's CLI makes it a float
        values[name] = value
    return values


# ---- executing ------------------------------------------------------------------------------------------------
@dataclass
class CaseError:
    """Why a case could not run to its end, and the failing cell when there is one."""

    kind: str  # exception | timeout | dead kernel | could not run | bad baseline
    message: str
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    cell_source: str = ""


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


class _Deadline:
    """nbclient timeout_func: the time left for the whole notebook, counted from its first cell."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.end = seconds, None

    def __call__(self, cell: Any) -> float:
        now = time.monotonic()
        if self.end is None:
            self.end = now + self.seconds
        return max(0.001, self.end - now)  # 0 would mean 'no timeout' to nbclient


def _running_cell(notebook: Path) -> str:
    """Source of the last cell papermill started: the one running when the kernel timed out or died."""
    import nbformat

    try:
        nb = nbformat.read(str(notebook), as_version=4)
    except Exception:  # noqa: BLE001  (the notebook may not have been written at all)
        return ""
    started = [c for c in nb.cells if c.cell_type == "code" and c.metadata.get("papermill", {}).get("start_time")]
    return started[-1].source if started else ""


def execute(notebook: Path, output: Path, cwd: Path, parameters: Mapping[str, Any],
            timeout_s: float) -> CaseError | None:
    """Run `notebook` with papermill into `output` (kept whatever happens); None on success."""
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    try:
        pm.execute_notebook(str(notebook), str(output), parameters=dict(parameters), kernel_name=KERNEL,
                            cwd=str(cwd), progress_bar=False, timeout_func=_Deadline(timeout_s))
    except pm.PapermillExecutionError as e:
        return CaseError("exception", f"{e.ename}: {e.evalue}", e.ename, e.evalue,
                         strip_ansi("\n".join(e.traceback)), e.source)
    except CellTimeoutError:
        return CaseError("timeout", f"timed out: the notebook ran longer than timeout_s={timeout_s:g} s; raise "
                         "timeout_s or make it faster", cell_source=_running_cell(output))
    except DeadKernelError as e:
        return CaseError("dead kernel", f"the kernel died ({e}): out of memory, a crash in native code, or "
                         "os._exit()", cell_source=_running_cell(output))
    except Exception as e:  # noqa: BLE001  (a kernel that won't start, an unreadable notebook: this case fails)
        return CaseError("could not run", f"{type(e).__name__}: {e}", type(e).__name__, str(e),
                         traceback.format_exc())
    return None


# ---- baselines ------------------------------------------------------------------------------------------------
def baseline_path(case: Case, device_class: str) -> Path:
    return case.baselines / device_class / f"{case.id}.json"


def load_baseline(path: Path) -> dict[str, Any] | None:
    """A baseline file, or None when there is none yet. ValueError when it exists but can't be used."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"baseline {path} is not valid JSON ({e}); fix it or rewrite it with "
                         "--update-baselines") from None
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict) or \
            not all(isinstance(m, dict) and "value" in m for m in data["metrics"].values()):
        raise ValueError(f"baseline {path}: expected {{'metrics': {{name: {{'value': ...}}}}}}; rewrite it with "
                         "--update-baselines")
    return data


def _to_json(obj: Any, indent: str = "") -> str:
    """JSON for review: one key per line, but lists of plain values (curve points) on one line each."""
    inner = indent + "  "
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {_to_json(v, inner)}" for k, v in sorted(obj.items())]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(obj, list) and obj and any(isinstance(v, (list, dict)) for v in obj):
        return "[\n" + ",\n".join(inner + _to_json(v, inner) for v in obj) + f"\n{indent}]"
    return json.dumps(obj)


def write_baseline(path: Path, case: Case, parameters: Mapping[str, Any], metrics: Sequence[MetricResult],
                   curves: Mapping[str, list[list[float]]], device_class: str) -> None:
    from . import __version__

    data = {
        "case": case.id, "notebook": case.notebook.name, "device_class": device_class,
        "parameters": dict(parameters), "repeats": case.repeats, "workbench_version": __version__,
        "updated": datetime.date.today().isoformat(),
        "metrics": {m.name: {"value": encode_value(m.current), "direction": m.direction, "unit": m.unit}
                    for m in metrics if m.current is not None},
        "curves": {name: [[p[0], encode_value(p[1])] for p in pts] for name, pts in curves.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(_to_json(data) + "\n", encoding="utf-8")
    tmp.replace(path)


# ---- judging --------------------------------------------------------------------------------------------------
@dataclass
class MetricResult:
    """One metric of one case: the numbers, the rule that decided and why."""

    name: str
    verdict: str  # pass | fail | info | new | missing
    reason: str
    rule: Rule | None = None
    rule_source: str = ""
    current: float | None = None
    baseline: float | None = None
    values: list[float] = field(default_factory=list)  # one per repeat
    unit: str | None = None
    direction: str | None = None

    @property
    def failed(self) -> bool:
        return self.verdict in ("fail", "missing")

    @property
    def delta(self) -> float | None:
        if self.current is None or self.baseline is None:
            return None
        return self.current - self.baseline


def compare(case: Case, runs: Sequence[Records], baseline: Mapping[str, Any] | None) -> list[MetricResult]:
    """Judge the median over `runs` (one Records per repeat) of every metric against `baseline`."""
    values: dict[str, list[float]] = {}
    last: dict[str, RecordedMetric] = {}
    for rec in runs:
        for name, m in rec.metrics.items():
            values.setdefault(name, []).append(m.value)
            last[name] = m
    base = {k: {**v, "value": decode_value(v["value"])} for k, v in (baseline or {}).get("metrics", {}).items()}
    results = []
    for name in sorted(values):
        m = last[name]
        rule, source = case.rule_for(name, m.direction, m.tolerance)
        current = median(values[name])
        res = MetricResult(name, "new", "not in the baseline", rule, source, current, None, values[name], m.unit,
                           m.direction)
        if name in base:
            res.baseline = base[name]["value"]
            res.verdict, res.reason = rule.check(current, res.baseline, m.unit)
            if len(values[name]) > 1:
                res.reason = f"median of {len(values[name])}: {res.reason}"
        results.append(res)
    for name in sorted(set(base) - set(values)):
        rule, source = case.rule_for(name, base[name].get("direction"))
        verdict = "info" if rule.mode == "info" else "missing"
        results.append(MetricResult(name, verdict, "in the baseline but not recorded by this run", rule, source,
                                    None, base[name]["value"], [], base[name].get("unit"),
                                    base[name].get("direction")))
    return results


@dataclass
class CaseResult:
    """What happened to one case: status, per-metric verdicts, curves, executed notebooks, error."""

    case: Case
    status: str
    parameters: dict[str, Any] = field(default_factory=dict)
    metrics: list[MetricResult] = field(default_factory=list)
    curves: dict[str, list[list[float]]] = field(default_factory=dict)
    baseline_curves: dict[str, list[list[float]]] = field(default_factory=dict)
    notebooks: list[Path] = field(default_factory=list)
    error: CaseError | None = None
    duration_s: float = 0.0
    baseline_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed_metrics(self) -> list[MetricResult]:
        return [m for m in self.metrics if m.failed]

    def summary_line(self) -> str:
        if self.status == ERROR and self.error:
            return f"{self.case.id}: ERROR ({self.error.kind}) {self.error.message.splitlines()[0]}"
        if self.status == FAILED:
            return f"{self.case.id}: FAILED {', '.join(m.name for m in self.failed_metrics)}"
        return f"{self.case.id}: {self.status} ({len(self.metrics)} metrics, {self.duration_s:.1f} s)"


def run_case(case: Case, overrides: Mapping[str, Any], out: Path, *, device_class: str, has_cuda: bool,
             update_baselines: bool) -> CaseResult:
    """Execute one case (all its repeats) under out/cases/<id>/ and judge it; never raises for the case's faults."""
    params = {**case.parameters, **overrides}
    result = CaseResult(case, SKIPPED, params, baseline_path=baseline_path(case, device_class))
    if case.needs_gpu and not has_cuda:
        result.notes.append("skipped: needs_gpu is set and this machine has no CUDA GPU")
        return result
    case_dir = out / "cases" / case.id
    if case_dir.exists():  # a previous report in the same --out: its runs must not mix with these
        shutil.rmtree(case_dir)
    started = time.monotonic()
    runs = []
    for k in range(case.repeats):
        work = case_dir if case.repeats == 1 else case_dir / f"repeat{k + 1}"
        work.mkdir(parents=True)
        executed = work / case.notebook.name
        result.notebooks.append(executed)
        error = execute(case.notebook, executed, work, params, case.timeout_s)
        if error is not None:
            result.status, result.error = ERROR, error
            break
        runs.append(read_records(executed))
    result.duration_s = time.monotonic() - started
    if result.error is not None:
        return result
    try:
        baseline = load_baseline(result.baseline_path)
    except ValueError as e:
        result.status, result.error = ERROR, CaseError("bad baseline", str(e))
        return result
    result.metrics = compare(case, runs, baseline)
    result.curves = runs[0].curves
    result.baseline_curves = {k: [[p[0], decode_value(p[1])] for p in v]
                              for k, v in (baseline or {}).get("curves", {}).items()}
    for name in sorted({n for rec in runs for n in rec.repeated}):
        result.notes.append(f"{name} was recorded more than once in one execution; the last value counts")
    if not result.metrics:
        result.notes.append("the notebook recorded no metrics: call wb.record(name, value) or launch a run")
    if baseline is not None and baseline.get("parameters", params) != params:
        result.notes.append(f"parameters differ from the baseline's ({baseline.get('parameters')}): the "
                            "comparison may be meaningless")
    if update_baselines:
        write_baseline(result.baseline_path, case, params, result.metrics, result.curves, device_class)
        result.status = UPDATED
        result.notes.append(f"baseline written to {result.baseline_path}")
    elif baseline is None:
        result.status = NEW
        result.notes.append(f"no baseline for {device_class} yet ({result.baseline_path}): run again with "
                            "--update-baselines to create it")
    else:
        result.status = FAILED if result.failed_metrics else PASSED
    return result


def exit_code(results: Sequence[CaseResult]) -> int:
    """2 when a case could not run, else 1 when one regressed, else 0."""
    if any(r.status == ERROR for r in results):
        return 2
    return 1 if any(r.status == FAILED for r in results) else 0


def run(targets: list[Path], *, parameters: dict[str, str], out: Path, baselines: Path | None,
        update_baselines: bool, junit: Path | None, profile: str | None) -> int:
    """`workbench regress`: execute every case, compare to baselines, write the report; returns the exit code."""
    from .hardware import detect
    from .report import write_junit, write_report

    cases = select_profile(load_targets(targets, baselines), profile)  # every ValueError before anything runs
    overrides = parse_parameters(parameters)
    hw = detect()
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for i, case in enumerate(cases, 1):
        log.info("[%d/%d] %s: %s", i, len(cases), case.id, case.notebook)
        result = run_case(case, overrides, out, device_class=hw.device_class, has_cuda=hw.has_cuda,
                          update_baselines=update_baselines)
        log.info("  %s", result.summary_line())
        results.append(result)
    report = write_report(results, out, device_class=hw.device_class)
    if junit is not None:
        write_junit(results, Path(junit))
    code = exit_code(results)
    counts = {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, ERROR, NEW, UPDATED, SKIPPED)}
    log.info("%s; report: %s", ", ".join(f"{n} {s}" for s, n in counts.items() if n), report)
    if counts[NEW]:
        log.info("%d case(s) have no baseline for %s: check the report, then run again with --update-baselines",
                 counts[NEW], hw.device_class)
    return code
