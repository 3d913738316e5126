"""The fraction of its datasheet peak an accelerator's matrix multiplies reach in a training step,
by precision and model size, from published measurements: the catalog's `measurements:` (each a
run someone published: its source, model, GPUs, layout, batch, precision and tokens/s) and each
accelerator's `efficiency:` entries, which cite the measurements their value comes from. An
accelerator without a published figure takes the nearest class's (`efficiency_from:`), and says
so."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

DEFAULT_EFFICIENCY = 0.4
"""For an accelerator entry with no `efficiency:` (a user's own): a typical fraction, said so."""
FALLBACK_PRECISION = "bf16"
"""A precision with no entry of its own (tf32, fp32; fp8 where none was measured) takes this."""
MEASUREMENT_FIELDS = (
    "id",
    "source",
    "url",
    "date",
    "accelerator",
    "hardware",
    "model",
    "params",
    "shape",
    "flops_per_token",
    "gpus",
    "nodes",
    "parallelism",
    "micro_batch",
    "grad_accum",
    "precision",
    "tokens_per_s_per_gpu",
)
SHAPE_FIELDS = ("n_layer", "n_embd", "n_head", "seq_len")
POSITIVE = (
    "params",
    "flops_per_token",
    "gpus",
    "nodes",
    "micro_batch",
    "grad_accum",
    "tokens_per_s_per_gpu",
)


@dataclass(frozen=True)
class Measurement:
    """A published training run's throughput, as the catalog cites it."""

    id: str
    source: str
    """The document and table."""
    url: str
    date: str
    accelerator: str
    """The catalog entry whose peak its MFU is against."""
    hardware: str
    """What it ran on, in the source's words."""
    model: str
    params: int
    shape: dict[str, int]
    """n_layer, n_embd, n_head, seq_len: the transformer's shape (the bench's stand-in takes it)."""
    flops_per_token: float
    """Training FLOPs per token of the published model: 6 x its matmul parameters (the embedding
    lookup is none) plus 12 x layers x width x sequence for attention, counted in full."""
    gpus: int
    nodes: int
    parallelism: str
    micro_batch: int
    grad_accum: int
    precision: str
    tokens_per_s_per_gpu: float
    activation_checkpointing: str = "none"
    compile: bool = False
    mfu: float | None = None
    """The MFU the source itself publishes, where it does (its own FLOP count)."""
    notes: str = ""

    def mfu_at(self, peak_flops: float) -> float:
        """Model FLOPs per second per GPU over `peak_flops`: tokens/s x flops_per_token / peak."""
        return self.tokens_per_s_per_gpu * self.flops_per_token / peak_flops


@dataclass(frozen=True)
class Efficiency:
    """One value of an accelerator's efficiency: for these precisions, models below `params_below`
    parameters (None: any size), from the cited measurements."""

    precisions: tuple[str, ...]
    value: float
    cites: tuple[str, ...]
    params_below: float | None = None
    basis: str = ""
    """How the value follows from the runs' MFU: 'measured' (one run's), 'mean' (of several)."""
    derived_from: str | None = None
    """The accelerator whose value this is, where this one has no published figure."""
    cited: tuple[Measurement, ...] = field(default=(), compare=False)


def parse_measurement(entry: Any, source: str) -> Measurement:
    """One `measurements:` entry, checked: ValueError naming the entry and the field."""
    if not isinstance(entry, dict):
        raise ValueError(
            f"{source}: each measurement is a mapping with "
            f"{', '.join(MEASUREMENT_FIELDS)}; got {entry!r}"
        )
    where = f"{source}: measurement {entry.get('id', '?')!r}"
    missing = [f for f in MEASUREMENT_FIELDS if f not in entry]
    if missing:
        raise ValueError(
            f"{where}: missing field(s) {', '.join(missing)} "
            f"(each needs {', '.join(MEASUREMENT_FIELDS)})"
        )
    known = set(Measurement.__dataclass_fields__)
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    shape = entry["shape"]
    if not isinstance(shape, dict) or not all(
        isinstance(shape.get(k), int) and shape[k] > 0 for k in SHAPE_FIELDS
    ):
        raise ValueError(
            f"{where}: shape={shape!r}: use "
            "{n_layer: 32, n_embd: 4096, n_head: 32, seq_len: 2048}"
        )
    for key in POSITIVE:
        if not isinstance(entry[key], (int, float)) or entry[key] <= 0:
            raise ValueError(f"{where}: {key}={entry[key]!r}: must be a positive number")
    mfu = entry.get("mfu")
    if mfu is not None and not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise ValueError(
            f"{where}: mfu={mfu!r}: a fraction in (0, 1] (0.4644 for 46.44%), or leave it out"
        )
    return Measurement(
        **{
            **entry,
            "id": str(entry["id"]),
            "date": str(entry["date"]),
            "params": int(entry["params"]),
            "compile": bool(entry.get("compile")),
            "flops_per_token": float(entry["flops_per_token"]),
            "shape": {k: int(shape[k]) for k in SHAPE_FIELDS},
        }
    )


def parse_efficiency(entries: Any, where: str, peaks: dict[str, Any]) -> tuple[Efficiency, ...]:
    """An accelerator's `efficiency:` list, checked: each value in (0, 1], for precisions it has a
    peak for, citing at least one measurement (looked up among the measurements by resolve())."""
    if not isinstance(entries, list):
        raise ValueError(
            f"{where}: efficiency={entries!r}: a list of "
            "{precision: [bf16], value: 0.43, from: [measurement id, ...]}"
        )
    return tuple(_entry(e, f"{where}: efficiency[{i}]", peaks) for i, e in enumerate(entries))


def _entry(e: Any, at: str, peaks: dict[str, Any]) -> Efficiency:
    if not isinstance(e, dict):
        raise ValueError(f"{at}: {e!r}: use {{precision: [bf16], value: 0.43, from: [an id]}}")
    value, precisions, cites = e.get("value"), e.get("precision"), e.get("from")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(
            f"{at}: value={value!r}: must be in (0, 1], the fraction of the datasheet "
            "peak its matrix multiplies reach (0.43 for 43%)"
        )
    precisions = [precisions] if isinstance(precisions, str) else precisions
    if not precisions or any(p not in peaks for p in precisions):
        raise ValueError(
            f"{at}: precision={e.get('precision')!r}: name precisions its "
            f"peak_tflops lists ({', '.join(peaks)})"
        )
    if not cites or not isinstance(cites, list):
        raise ValueError(
            f"{at}: from={cites!r}: every efficiency cites the measurements it comes "
            "from: from: [id, ...], each id an entry of measurements: (its source, "
            "url and run)"
        )
    below = e.get("params_below")
    if below is not None and (not isinstance(below, (int, float)) or below <= 0):
        raise ValueError(
            f"{at}: params_below={below!r}: a parameter count (2.0e+9), or leave it "
            "out for any size"
        )
    return Efficiency(
        precisions=tuple(precisions),
        value=float(value),
        cites=tuple(map(str, cites)),
        params_below=None if below is None else float(below),
        basis=str(e.get("basis", "")),
    )


def resolve(
    accelerators: dict[str, Any], measurements: dict[str, Measurement], inherit: dict[str, str]
) -> dict[str, Any]:
    """The accelerators with their efficiency entries' measurements attached; each of `inherit`
    (name -> the accelerator its efficiency_from names) also gets the other's entries for the
    precisions it doesn't list itself."""

    def cited(name: str, e: Efficiency) -> Efficiency:
        unknown = [c for c in e.cites if c not in measurements]
        if unknown:
            raise ValueError(
                f"accelerator {name!r}: efficiency cites "
                f"{', '.join(map(repr, unknown))}, not among the measurements "
                f"({', '.join(sorted(measurements)) or 'none'})"
            )
        return replace(e, cited=tuple(measurements[c] for c in e.cites))

    out = {
        name: replace(a, efficiency=tuple(cited(name, e) for e in a.efficiency))
        for name, a in accelerators.items()
    }
    for name, source in inherit.items():
        if source not in out:
            raise ValueError(
                f"accelerator {name!r}: efficiency_from={source!r}: not in the "
                f"catalog; known: {', '.join(sorted(out))}"
            )
        own = {p for e in out[name].efficiency for p in e.precisions}
        taken = [
            replace(
                e,
                derived_from=e.derived_from or source,
                precisions=tuple(p for p in e.precisions if p not in own),
            )
            for e in out[source].efficiency
            if set(e.precisions) - own
        ]
        out[name] = replace(out[name], efficiency=out[name].efficiency + tuple(taken))
    for m in measurements.values():
        if m.accelerator not in out:
            raise ValueError(
                f"measurement {m.id!r}: accelerator={m.accelerator!r}: not in the "
                f"catalog; known: {', '.join(sorted(out))}"
            )
    return out


def matmul_efficiency(accel: Any, precision: str, params: int) -> tuple[float, str]:
    """The fraction of `accel`'s `precision` peak the matrix multiplies of a model of `params`
    parameters reach, and what it rests on, in words."""
    entries = [e for e in accel.efficiency if precision in e.precisions]
    fallback = ""
    if not entries and precision != FALLBACK_PRECISION:
        entries = [e for e in accel.efficiency if FALLBACK_PRECISION in e.precisions]
        fallback = f"no {precision} figure, {FALLBACK_PRECISION}'s; "
    if not entries:
        return DEFAULT_EFFICIENCY, (
            f"{DEFAULT_EFFICIENCY:.0%}, a typical fraction: the catalog "
            f"has no efficiency for {accel.name} (add efficiency: to its "
            "entry)"
        )
    ordered = sorted(entries, key=lambda e: e.params_below or float("inf"))
    chosen = next(
        (e for e in ordered if e.params_below is None or params < e.params_below), ordered[-1]
    )
    size = band(chosen, entries)
    size = "any size" if size == "any" else f"models with {size} parameters"
    derived = (
        f"{chosen.derived_from}'s, no published figure for {accel.name}: "
        if chosen.derived_from
        else ""
    )
    runs = runs_words(chosen.cited) or ", ".join(chosen.cites)
    return chosen.value, (
        f"{chosen.value:.0%} ({fallback}{derived}{size}, this one "
        f"{params / 1e9:.3g}B: {chosen.basis or 'measured'} MFU of {runs})"
    )


def runs_words(runs: tuple[Measurement, ...]) -> str:
    """'MPT-1B on 8 GPUs, MPT-7B on 8 GPUs (MosaicML ..., 2023-10-19)': the runs, by source."""
    by_source: dict[tuple[str, str], list[Measurement]] = {}
    for m in runs:
        by_source.setdefault((m.source, m.date), []).append(m)
    return "; ".join(
        f"{', '.join(f'{m.model} on {m.gpus * m.nodes} GPUs' for m in group)} ({source}, {date})"
        for (source, date), group in by_source.items()
    )


def band(e: Efficiency, entries: tuple[Efficiency, ...] | list[Efficiency]) -> str:
    """'under 0.2B', '0.2B to 2B', '2B or more' or 'any': the model sizes `e` is for, among
    `entries` of its precisions."""
    bounds = sorted(
        o.params_below for o in entries if o.params_below and set(o.precisions) & set(e.precisions)
    )
    below = [b for b in bounds if e.params_below is None or b < e.params_below]
    if e.params_below is None:
        return f"{below[-1] / 1e9:g}B or more" if below else "any"
    if below:
        return f"{below[-1] / 1e9:g}B to {e.params_below / 1e9:g}B"
    return f"under {e.params_below / 1e9:g}B"
