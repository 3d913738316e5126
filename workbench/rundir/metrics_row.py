"""metrics.jsonl: one schema (versioned) for its rows, as `Summary` is summary.json's.

Rank 0 writes a training row every `log_every` steps (training/observe/metrics_log.py) and an eval
row after each evaluation (training/evaluation.py); both are a `MetricsRow`. A row is written flat,
one JSON object per line, with only the keys it has a value for: an eval row is {step, eval_loss,
eval_<metric>...}.
"""

from __future__ import annotations

import logging
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from workbench.utils.typecheck import type_ok

log = logging.getLogger("workbench")

METRICS_SCHEMA_VERSION = 1
"""Bumped when a key changes meaning or type; readers accept older versions (missing keys are None).

Rows written before rows were versioned carry no `schema_version`: they read as version 0, whose
keys and meanings are version 1's, and are written back without the key (an old file keeps its
shape)."""
VERSION_KEY = "schema_version"
EVAL_PREFIX = "eval_"
"""Eval metrics are written as top-level 'eval_<name>' keys."""
PHASES = ("data", "compute", "comm", "optimizer", "other")
"""The step-time breakdown's parts (training/observe/breakdown.py measures them), in the order the
dashboard stacks them; a row has a '<phase>_ms_per_rank' list for each."""

PerRank = list[float | int | None]
"""One value per rank, rank 0 first; None where that rank did not measure it."""


@dataclass(kw_only=True)
class MetricsRow:
    """One line of metrics.jsonl: a logging window's training numbers, or one evaluation's."""

    step: int
    """Optimizer steps done when the row was written (from 1; a resumed run continues the count)."""
    epoch: int | None = None
    """Passes over the training data completed before the window's last micro-batch (0 at first)."""
    loss: float | None = None
    """Training loss: the mean over the window's steps and over ranks. None in an eval row."""
    lr: float | None = None
    """Learning rate of the window's last step."""
    step_time_s: float | None = None
    """Seconds per step over the window (rank 0's wall time, the metrics all-gather included)."""
    samples_per_s: float | None = None
    """Samples per second over the window, all ranks together: global batch / step_time_s."""
    peak_memory_bytes: int | None = None
    """Bytes, max over ranks: CUDA max allocated, or peak RSS on CPU."""
    peak_memory_bytes_per_rank: list[int] | None = None
    """Bytes per rank, as peak_memory_bytes."""
    skipped_steps: int | None = None
    """fp16 steps the loss scaler skipped so far (overflow), max over ranks."""
    params_bytes_per_rank: list[int] | None = None
    """Bytes of parameters each rank holds (what sharding saved)."""
    grads_bytes_per_rank: list[int] | None = None
    """Bytes of gradients each rank holds."""
    optimizer_bytes_per_rank: list[int] | None = None
    """Bytes of optimizer state each rank holds."""
    samples: int | None = None
    """Samples trained so far, all ranks and sessions together."""
    elapsed_s: float | None = None
    """Seconds in training steps so far, over all sessions (eval and checkpoints excluded), taken
    before this window's last step was added."""
    eta_s: float | None = None
    """Seconds left to max_steps at this window's step time."""
    step_time_ms_per_rank: list[float] | None = None
    """Milliseconds per step over the window, on each rank's own clock (without the all-gather)."""
    data_ms_per_rank: list[float] | None = None
    """Milliseconds per step each rank waited for its next batch (the breakdown, see PHASES)."""
    compute_ms_per_rank: list[float] | None = None
    """Milliseconds per step of forward and backward (and of communication where not measured)."""
    comm_ms_per_rank: list[float] | None = None
    """Milliseconds per step of gradient communication that compute did not hide."""
    optimizer_ms_per_rank: list[float] | None = None
    """Milliseconds per step in the optimizer step."""
    other_ms_per_rank: list[float] | None = None
    """Milliseconds per step in the rest of the loop (logging, agreement, progress)."""
    comm_measured: bool | None = None
    """Whether comm_ms_per_rank was measured (DDP); False: collectives are counted in compute."""
    slowest_rank: int | None = None
    """The straggler: the rank with the most time per step in its own work (data, compute,
    optimizer), by enough and over enough windows to hold the others back
    (training/observe/verdicts.py); None when no rank does."""
    verdicts: list[str] | None = None
    """What limits the step, in words with the fix (training/observe/verdicts.py); [] when nothing
    does."""
    gpu_util_pct_per_rank: PerRank | None = None
    """Device monitor: GPU utilisation in %, the window's mean (NVML only)."""
    gpu_mem_used_bytes_per_rank: PerRank | None = None
    """Device monitor: GPU memory used in bytes (the device's, or PyTorch's reserve), window max."""
    gpu_power_w_per_rank: PerRank | None = None
    """Device monitor: GPU power in W, the window's mean."""
    gpu_temp_c_per_rank: PerRank | None = None
    """Device monitor: GPU temperature in °C, window max."""
    cpu_pct_per_rank: PerRank | None = None
    """Device monitor: the rank process's CPU in % (100 per busy core), the window's mean."""
    rss_bytes_per_rank: PerRank | None = None
    """Device monitor: the rank process's resident memory in bytes, window max."""
    grad_norm: float | None = None
    """Gradient norm of the window's last step, before clipping (when measured)."""
    tokens_per_s: float | None = None
    """Tokens per second over the window, all ranks together (token tasks only)."""
    mfu: float | None = None
    """Model FLOPs utilisation over the window, 0 to 1 (GPUs with a known peak)."""
    eval_loss: float | None = None
    """Mean loss over the eval set, all ranks together. None in a training row."""
    eval: dict[str, float] = field(default_factory=dict)
    """The task's other eval metrics (the extra values its loss returns, averaged over the eval
    set), under their written names 'eval_<metric>'."""
    schema_version: int = METRICS_SCHEMA_VERSION
    """Version of this schema the row was written with (0: before rows were versioned)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version doesn't know (from a newer workbench, or by hand), kept on rewrite."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_train(self) -> bool:
        """A training window's row (an eval row has no training loss)."""
        return self.loss is not None

    @property
    def is_eval(self) -> bool:
        return self.eval_loss is not None

    def phases_ms(self) -> dict[str, list[float]] | None:
        """{phase: milliseconds per step, per rank} in PHASES order; None without a breakdown."""
        parts = (
            self.data_ms_per_rank,
            self.compute_ms_per_rank,
            self.comm_ms_per_rank,
            self.optimizer_ms_per_rank,
            self.other_ms_per_rank,
        )
        if any(part is None for part in parts):
            return None
        return dict(zip(PHASES, typing.cast("tuple[list[float], ...]", parts)))

    def set_phases_ms(self, parts: Mapping[str, list[float]]) -> None:
        """Set the breakdown from {phase: milliseconds per step, per rank}, each phase of PHASES."""
        (
            self.data_ms_per_rank,
            self.compute_ms_per_rank,
            self.comm_ms_per_rank,
            self.optimizer_ms_per_rank,
            self.other_ms_per_rank,
        ) = (list(parts[p]) for p in PHASES)

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value has the wrong type."""
        for name, check, hint in _CHECKS:
            value = getattr(self, name)
            if not check(value):
                raise ValueError(
                    f"metrics row at step {self.step!r}: {name}={value!r:.80} is not {hint}"
                )
        for key, value in self.eval.items():
            if not key.startswith(EVAL_PREFIX) or key in _KNOWN or not _number(value):
                raise ValueError(
                    f"metrics row at step {self.step}: eval[{key!r}]={value!r:.80}: "
                    f"expected '{EVAL_PREFIX}<metric>' (not eval_loss) with a number"
                )
        clash = sorted(set(self.extra) & (_KNOWN | {VERSION_KEY}))
        if clash:
            raise ValueError(f"metrics row at step {self.step}: extra holds known keys {clash}")

    def to_dict(self) -> dict[str, Any]:
        """The row's JSON object: flat, without the keys that are None, the version last."""
        out = {name: value for name in _ORDER if (value := getattr(self, name)) is not None}
        out.update(self.eval)
        out.update(self.extra)
        if self.schema_version:
            out[VERSION_KEY] = self.schema_version
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetricsRow:
        """A row as read from metrics.jsonl, of any version: missing keys are None, numeric
        'eval_<metric>' keys go to `eval`, other unknown keys to `extra`. A known key of the wrong
        type raises ValueError naming it."""
        if not isinstance(data, Mapping):
            # A line of the file that isn't an object is a bad row like any other: ValueError.
            raise ValueError(  # noqa: TRY004
                f"a metrics row is a JSON object, not {type(data).__name__}: {data!r:.80}"
            )
        rest = dict(data)
        known = {name: rest.pop(name) for name in _ORDER if name in rest}
        if "step" not in known:
            raise ValueError(f"metrics row without a step: {dict(data)!r:.120}")
        version = rest.pop(VERSION_KEY, 0)
        evals = {
            k: rest.pop(k) for k in list(rest) if k.startswith(EVAL_PREFIX) and _number(rest[k])
        }
        return cls(**known, eval=evals, extra=rest, schema_version=version)

    @classmethod
    def for_eval(cls, step: int, metrics: Mapping[str, float]) -> MetricsRow:
        """An eval row from evaluate()'s {'eval_loss': ..., 'eval_<metric>': ...}."""
        row = cls.from_dict({**metrics, "step": step, VERSION_KEY: METRICS_SCHEMA_VERSION})
        if row.extra:
            raise ValueError(f"eval metrics are numbers named '{EVAL_PREFIX}<metric>': {row.extra}")
        return row


def newest_train_row(rows: Iterable[dict[str, Any]], path: Path) -> dict[str, Any] | None:
    """Of `rows` (metrics.jsonl's, newest first: RunDir.tail_rows), the first training row that
    fits the schema; None when there is none. A row with a loss that doesn't fit (a value of the
    wrong type, written by hand or by a tool) is skipped with a warning naming the file and why:
    the readers of the newest row (`workbench status`, a run's repr, the dashboard) show the one
    before it rather than fail."""
    for row in rows:
        if "loss" not in row:
            continue
        try:
            MetricsRow.from_dict(row)
        except ValueError as e:
            _warn_skipped(path, str(e))
            continue
        return row
    return None


_SKIPPED: set[tuple[str, str]] = set()
"""Rows already warned about: a reader that polls (the dashboard) warns about each once."""


def _warn_skipped(path: Path, problem: str) -> None:
    key = (str(path), problem)
    if key not in _SKIPPED:
        _SKIPPED.add(key)
        log.warning("%s: skipped a metrics row that doesn't fit the schema: %s", path, problem)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A test of a JSON value against a field's type hint (an int passes for a float, a bool only
    for a bool).

    Readers check every row of a file on each poll, and a row of 8 ranks holds ~200 numbers: exact
    types are tested first, in C where possible; isinstance only for what that refuses."""

    def slow(v: Any) -> bool:
        return type_ok(v, hint)

    leaves = _exact_types(hint)
    if leaves is not None:
        return lambda v: type(v) in leaves or slow(v)
    args = typing.get_args(hint)
    if _is_union(hint) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        is_list = typing.get_origin(inner) is list
        items = _exact_types(typing.get_args(inner)[0]) if is_list else None
        if items is not None:
            return lambda v: (
                v is None or (type(v) is list and items.issuperset(map(type, v))) or slow(v)
            )
    return slow


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


_PLAIN: dict[Any, tuple[type, ...]] = {
    float: (int, float),
    int: (int,),
    bool: (bool,),
    str: (str,),
    type(None): (type(None),),
}


def _exact_types(hint: Any) -> frozenset[type] | None:
    """The exact types a JSON value of `hint` has, when it is a union of plain types; else None."""
    args = typing.get_args(hint) if _is_union(hint) else (hint,)
    if not all(arg in _PLAIN for arg in args):
        return None
    return frozenset(t for arg in args for t in _PLAIN[arg])


_HINTS = typing.get_type_hints(MetricsRow)
_CHECKS = [
    (f.name, _checker(_HINTS[f.name]), f.type) for f in fields(MetricsRow) if f.name != "extra"
]
_ORDER = tuple(
    f.name for f in fields(MetricsRow) if f.name not in ("eval", "schema_version", "extra")
)
"""The keys of one field each, in the order a row writes them (training rows' order as it was)."""
_KNOWN = frozenset(_ORDER)
