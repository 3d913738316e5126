"""Suites: the regression cases as data, validated before anything runs.

A suite is data, a YAML file (paths relative to it):

    name: smoke                      # default: the file's stem; case ids are '<name>.<case name>'
    baselines: baselines             # default: baselines/ beside the suite file
    defaults:                        # any case key but notebook/name/description, for every case
      profile: smoke
      tolerances: {"*.samples_per_s": {mode: higher_is_better, rel: 0.5}}
    cases:
      - notebook: ../notebooks/01_quickstart.ipynb
        name: quickstart             # default: the notebook's stem
        parameters: {max_steps: 30}  # papermill parameters; `-p NAME VALUE` on the CLI wins
        profile: smoke               # or a list; `--profile` runs only the cases that have it
        timeout_s: 600               # all cells together (kernel start not counted)
        output_limit_mb: 50          # output kept per execution; past it the case is stopped
        needs_gpu: false             # without CUDA the case is skipped, not failed
        repeats: 1                   # run N times and compare the median (noisy timings)
        tolerances:                  # metric name or glob -> rule; beats the notebook's own
          "*.final_loss": {mode: abs, abs: 0.05}
          "*.wall_time_s": info
        device_tolerances:           # device class (or glob) -> tolerances there; beat the above
          cpu: {"*.samples_per_s": {mode: higher_is_better, rel: 0.85}}

Baselines live in <baselines>/<device class>/<case id>.json ('cpu', 'cuda-H100', ...) and are
written by `--update-baselines`. A notebook target (.ipynb) is one case with default settings,
baselines beside it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.regress.rules import Rule, default_rule, parse_rule
from workbench.utils.files import load_yaml, read_yaml
from workbench.utils.suggest import reject_unknown

DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_OUTPUT_LIMIT_MB = 50.0
"""Output one execution of a notebook may keep (text and data of all its cells, in MiB); past it
the kernel is stopped and the case is an 'output limit' error (output_cap.py)."""
_SUITE_KEYS = ("name", "description", "baselines", "defaults", "cases")
_DEFAULT_KEYS = (
    "parameters",
    "profile",
    "timeout_s",
    "output_limit_mb",
    "needs_gpu",
    "repeats",
    "tolerances",
    "device_tolerances",
)
_CASE_KEYS = ("notebook", "name", "description", *_DEFAULT_KEYS)
_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


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
    output_limit_mb: float = DEFAULT_OUTPUT_LIMIT_MB
    needs_gpu: bool = False
    repeats: int = 1
    tolerances: tuple[dict[str, Any], ...] = ()
    """Case-level then suite-level tables of metric name or glob -> rule spec; the first match
    decides."""
    device_tolerances: tuple[dict[str, Any], ...] = ()
    """Case-level then suite-level tables of device class (or glob) -> tolerances; they beat
    `tolerances`."""
    source: str = ""

    def rule_for(
        self,
        name: str,
        direction: str | None,
        notebook_tolerance: Any = None,
        device_class: str | None = None,
    ) -> tuple[Rule, str]:
        """The rule for metric `name` on `device_class` and where it came from: the suite (for that
        device class, then for all), the notebook, or the default."""
        tables = [
            (table, f"{self.source} device_tolerances[{cls!r}]", f" on {cls}")
            for by_device in self.device_tolerances
            for cls, table in by_device.items()
            if device_class is not None and fnmatch.fnmatchcase(device_class, cls)
        ]
        tables += [(table, f"{self.source} tolerances", "") for table in self.tolerances]
        for table, where, on in tables:
            for pattern, spec in ([(name, table[name])] if name in table else []) + list(
                table.items()
            ):
                if pattern == name or fnmatch.fnmatchcase(name, pattern):
                    return parse_rule(
                        spec, direction, where=f"{where}[{pattern!r}]"
                    ), f"suite '{pattern}'{on}"
        if notebook_tolerance is not None:
            return parse_rule(
                notebook_tolerance, direction, where=f"notebook tolerance of {name!r}"
            ), "notebook"
        return default_rule(direction), "default"


def _check_fields(data: Mapping[str, Any], where: str) -> None:
    """Types of the case/default fields, each error naming the field and a value that would work."""
    if "parameters" in data and not (
        isinstance(data["parameters"], Mapping)
        and all(isinstance(k, str) for k in data["parameters"])
    ):
        raise ValueError(
            f"{where}: parameters={data['parameters']!r}: use a mapping, e.g. {{max_steps: 30}}"
        )
    prof = data.get("profile")
    if prof is not None and not (
        isinstance(prof, str) or (isinstance(prof, list) and all(isinstance(p, str) for p in prof))
    ):
        raise ValueError(
            f"{where}: profile={prof!r}: use a name or a list of names, e.g. smoke or [smoke, full]"
        )
    t = data.get("timeout_s")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
        raise ValueError(f"{where}: timeout_s={t!r}: use seconds > 0, e.g. 600")
    cap = data.get("output_limit_mb")
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf")
    ):
        raise ValueError(
            f"{where}: output_limit_mb={cap!r}: use MiB > 0, e.g. {DEFAULT_OUTPUT_LIMIT_MB:g} "
            "(the default)"
        )
    if "needs_gpu" in data and not isinstance(data["needs_gpu"], bool):
        raise ValueError(f"{where}: needs_gpu={data['needs_gpu']!r}: use true or false")
    n = data.get("repeats")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(
            f"{where}: repeats={n!r}: use a whole number >= 1 (e.g. 3 for noisy timings)"
        )
    if data.get("tolerances") is not None:
        _check_tolerances(data["tolerances"], f"{where}: tolerances")
    by_device = data.get("device_tolerances")
    if by_device is not None:
        if not isinstance(by_device, Mapping) or not all(isinstance(k, str) for k in by_device):
            raise ValueError(
                f"{where}: device_tolerances={by_device!r}: use a mapping of device class (or "
                "glob) to tolerances, e.g. {cpu: {'*.samples_per_s': info}}"
            )
        for cls, tol in by_device.items():
            _check_tolerances(tol, f"{where}: device_tolerances[{cls!r}]")


def _check_tolerances(tol: Any, where: str) -> None:
    if not isinstance(tol, Mapping):
        raise ValueError(
            f"{where}={tol!r}: use a mapping of metric name (or glob) to rule, "
            "e.g. {'*.final_loss': {mode: abs, abs: 0.05}}"
        )
    for metric, spec in tol.items():
        # Direction is only known once the notebook runs; 'higher' accepts every spec that some
        # metric could use.
        parse_rule(spec, "higher", where=f"{where}[{metric!r}]")
        if (
            isinstance(spec, Mapping)
            and "mode" not in spec
            and spec.get("abs") is not None
            and spec.get("rel") is not None
        ):
            raise ValueError(
                f"{where}[{metric!r}] has abs and rel but no mode: set mode, "
                "e.g. {mode: lower_is_better, abs: 0.01, rel: 0.05}"
            )


def load_suite(path: Path, baselines: Path | None = None) -> list[Case]:
    """The cases of a suite file, validated (unknown keys, types, notebooks that exist) before
    anything runs."""
    data = read_yaml(path)
    suite, defaults = _suite_settings(data, path)
    root = (
        baselines
        if baselines is not None
        else path.parent / str(data.get("baselines", "baselines"))
    )
    return [
        _load_case(raw, f"{path}: cases[{i}]", path, suite, defaults, root)
        for i, raw in enumerate(data["cases"])
    ]


def _suite_settings(data: Any, path: Path) -> tuple[str, Mapping[str, Any]]:
    """The suite's name and its defaults for every case, checked along with the file's shape."""
    if not isinstance(data, Mapping) or not data.get("cases"):
        raise ValueError(
            f"{path}: a suite is a mapping with a non-empty 'cases:' list of {{notebook: ...}}"
        )
    reject_unknown(data, _SUITE_KEYS, str(path))
    suite = data.get("name", path.stem)
    if not isinstance(suite, str) or not _ID.match(suite):
        raise ValueError(f"{path}: name={suite!r}: use letters, digits, '_', '.', '-'")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise ValueError(
            f"{path}: defaults={defaults!r}: use a mapping of case keys, e.g. {{profile: smoke}}"
        )
    reject_unknown(defaults, _DEFAULT_KEYS, f"{path}: defaults")
    _check_fields(defaults, f"{path}: defaults")
    if not isinstance(data["cases"], list):
        raise ValueError(f"{path}: cases: use a list, each item a mapping with 'notebook:'")
    return suite, defaults


def _case_notebook(raw: Any, where: str, path: Path) -> Path:
    """The case's notebook, resolved against the suite file `path`, once the case's keys check."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: use a mapping such as {{notebook: ../notebooks/x.ipynb}}")
    reject_unknown(raw, _CASE_KEYS, where)
    if "notebook" not in raw:
        raise ValueError(
            f"{where}: missing 'notebook': the .ipynb to run, relative to the suite file"
        )
    notebook = (path.parent / str(raw["notebook"])).resolve()
    if notebook.suffix != ".ipynb" or not notebook.is_file():
        raise ValueError(
            f"{where}: notebook {raw['notebook']!r} not found (looked for {notebook}); "
            "paths are relative to the suite file"
        )
    return notebook


def _load_case(
    raw: Any, where: str, path: Path, suite: str, defaults: Mapping[str, Any], root: Path
) -> Case:
    """One item of the suite's cases, checked, with the suite's defaults under its own keys."""
    notebook = _case_notebook(raw, where, path)
    _check_fields(raw, where)
    name = raw.get("name", notebook.stem)
    if not isinstance(name, str) or not _ID.match(name):
        raise ValueError(
            f"{where}: name={name!r}: use letters, digits, '_', '.', '-' (it names files)"
        )
    merged = {**defaults, **raw}
    profile = merged.get("profile")
    return Case(
        id=f"{suite}.{name}",
        suite=suite,
        name=name,
        notebook=notebook,
        baselines=root,
        parameters={**defaults.get("parameters", {}), **raw.get("parameters", {})},
        profiles=tuple([profile] if isinstance(profile, str) else profile or ()),
        timeout_s=float(merged.get("timeout_s", DEFAULT_TIMEOUT_S)),
        output_limit_mb=float(merged.get("output_limit_mb", DEFAULT_OUTPUT_LIMIT_MB)),
        needs_gpu=merged.get("needs_gpu", False),
        repeats=merged.get("repeats", 1),
        tolerances=tuple(t for t in (raw.get("tolerances"), defaults.get("tolerances")) if t),
        device_tolerances=tuple(
            t for t in (raw.get("device_tolerances"), defaults.get("device_tolerances")) if t
        ),
        source=where,
    )


def load_targets(targets: Sequence[Path], baselines: Path | None = None) -> list[Case]:
    """Cases of every target: suites (.yaml/.yml) and single notebooks (.ipynb). Ids must be
    unique."""
    if not targets:
        raise ValueError(
            "no targets: name notebooks (.ipynb) or suite files (.yaml), e.g. regress/smoke.yaml"
        )
    cases: list[Case] = []
    baselines = None if baselines is None else Path(baselines).resolve()
    for target in map(Path, targets):
        if not target.is_file():
            raise ValueError(f"{target}: no such file; name a notebook (.ipynb) or a suite (.yaml)")
        if target.suffix in (".yaml", ".yml"):
            cases += load_suite(target, baselines)
        elif target.suffix == ".ipynb":
            nb = target.resolve()
            cases.append(
                Case(
                    id=nb.stem,
                    suite="notebooks",
                    name=nb.stem,
                    notebook=nb,
                    baselines=baselines if baselines is not None else nb.parent / "baselines",
                    source=str(target),
                )
            )
        else:
            raise ValueError(
                f"{target}: unknown kind of target; name a notebook (.ipynb) or a suite (.yaml)"
            )
    seen: dict[str, Case] = {}
    for case in cases:
        if case.id in seen:
            raise ValueError(
                f"case id {case.id!r} appears twice ({seen[case.id].source} and {case.source}); "
                "give one a different 'name:'"
            )
        seen[case.id] = case
    return cases


def select_profile(cases: list[Case], profile: str | None) -> list[Case]:
    """Cases of `profile` (bare notebook targets have none and always run); all cases when profile
    is None."""
    if profile is None:
        return cases
    chosen = [c for c in cases if profile in c.profiles or c.suite == "notebooks"]
    if not chosen:
        known = sorted({p for c in cases for p in c.profiles})
        raise ValueError(
            f"--profile {profile!r}: no case has it; profiles in these suites: "
            f"{', '.join(known) or 'none'}"
        )
    return chosen


def parse_parameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`-p NAME VALUE` strings to Python values, like papermill's CLI (YAML), '1e-3' read as a
    number too."""
    values: dict[str, Any] = {}
    for name, text in raw.items():
        if not str(name).isidentifier():
            raise ValueError(
                f"-p {name} {text}: parameter names are Python identifiers, e.g. -p max_steps 50"
            )
        if not isinstance(text, str):
            values[name] = text
            continue
        try:
            value = load_yaml(text, f"-p {name}")
        except ValueError:
            value = text
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            # YAML 1.1 reads 1e-3 as a string; papermill's CLI makes it a float
            value = float(value)
        values[name] = value
    return values
