"""`workbench bench estimate`'s cited section: the estimate against each published training run
the accelerator catalog cites (accelerators.yaml's `measurements:`).

Each run is estimated as a char-gpt model of its shape (layers, width, heads, sequence) on its
accelerator, GPU count, layout, batch and precision, learning from no run. The published model
differs from char-gpt in its vocabulary and blocks (Llama's gated MLP and grouped-query attention),
so the two are compared by MFU: the estimate's FLOPs per second over the peak against the published
tokens/s x the published model's FLOPs per token over the same peak. The estimated tokens/s is that
MFU turned back into the published model's tokens.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from workbench.config import RunConfig
from workbench.estimator.efficiency import Measurement


@dataclass
class CitedRow:
    """One published run against the estimate of its shape."""

    id: str
    model: str
    where: str
    """'8 x H100-SXM-80GB, zero3, bf16, 6 x 2048 tokens x 1': GPUs, layout, precision, batch."""
    cited_tokens_per_s: float
    """Per GPU, as published."""
    cited_mfu: float
    """Published tokens/s x the published model's FLOPs per token, over the accelerator's peak."""
    estimated_mfu: float | None = None
    """The estimate's FLOPs per second per GPU over the same peak."""
    estimated_tokens_per_s: float | None = None
    """Per GPU: the estimated MFU x the peak / the published model's FLOPs per token."""
    sets: str = ""
    """The accelerators whose catalog efficiency this run's figure is (part of); '' for a check."""
    note: str = ""

    @property
    def error(self) -> float | None:
        """Estimated over published, less 1."""
        return None if self.estimated_mfu is None else self.estimated_mfu / self.cited_mfu - 1


def standin(m: Measurement) -> RunConfig:
    """The published run as a char-gpt run of the same shape, layout, batch and precision."""
    fields: dict[str, Any] = {
        "parallelism": m.parallelism,
        "precision": m.precision,
        "activation_checkpointing": m.activation_checkpointing,
    }
    return RunConfig(
        task="char-gpt",
        micro_batch_size=m.micro_batch,
        grad_accum_steps=m.grad_accum,
        compile="blocks" if m.compile else "off",
        **fields,
        task_options={
            "preset": "small",
            "n_layer": m.shape["n_layer"],
            "n_embd": m.shape["n_embd"],
            "n_head": m.shape["n_head"],
            "block_size": m.shape["seq_len"],
        },
    )


def cited_row(m: Measurement, catalog: str | Path | None, runs_dir: Path) -> CitedRow:
    """The estimate of `m`'s stand-in (learning from `runs_dir`: keep it empty) against `m`."""
    from workbench.estimator import estimate
    from workbench.estimator.catalog import load_catalog
    from workbench.estimator.timing.gpu import matmul_precision

    accelerators = load_catalog(catalog)
    cfg, target = standin(m), accelerators[m.accelerator]
    peak = target.peak(matmul_precision(cfg, target)) or 0.0
    sets = ", ".join(
        name
        for name, a in accelerators.items()
        if any(m.id in e.cites and not e.derived_from for e in a.efficiency)
    )
    where = (
        f"{m.gpus * m.nodes} x {m.accelerator}, {m.parallelism}, {m.precision}, "
        f"{m.micro_batch} x {m.shape['seq_len']} tokens x {m.grad_accum}"
    )
    row = CitedRow(m.id, m.model, where, m.tokens_per_s_per_gpu, m.mfu_at(peak), sets=sets)
    try:
        est = estimate(cfg, m.accelerator, m.gpus, m.nodes, catalog=catalog, runs_dir=runs_dir)
    except ValueError as e:  # the stand-in can't be planned there: said in the row
        row.note = str(e).split(";")[0]
        return row
    row.estimated_mfu = est.flops_per_step / est.step_s / peak
    row.estimated_tokens_per_s = row.estimated_mfu * peak / m.flops_per_token
    if m.compile:
        row.note = "published with torch.compile; the estimate prices a compiled step as eager's"
    return row


def cited_rows(catalog: str | Path | None = None, ids: list[str] | None = None) -> list[CitedRow]:
    """Every measurement the catalogs cite (or those of `ids`), each against its estimate."""
    from workbench.estimator.catalog import load_measurements

    measured = load_measurements(catalog)
    unknown = sorted(set(ids or []) - set(measured))
    if unknown:
        raise ValueError(
            f"ids={unknown}: not among the catalog's measurements ({', '.join(sorted(measured))})"
        )
    with tempfile.TemporaryDirectory(prefix="workbench-cited-") as tmp:
        return [cited_row(measured[i], catalog, Path(tmp)) for i in (ids or list(measured))]


def cited_table(rows: list[CitedRow]) -> list[str]:
    """The cited section's lines."""
    lines = [
        "published runs the catalog cites (accelerators.yaml) against the estimate of a "
        "char-gpt model of their shape, layout and batch (nothing learnt); tokens/s per GPU; "
        "MFU against the same peak",
        f"  {'measurement':36} {'model':13} {'where':58} {'published':>10} {'estimated':>10} "
        f"{'MFU':>6} {'est.':>6} {'error':>7}  sets",
    ]
    for r in rows:
        est = (
            f"{r.estimated_tokens_per_s:10,.0f}"
            if r.estimated_tokens_per_s is not None
            else f"{'-':>10}"
        )
        mfu = f"{r.estimated_mfu:6.1%}" if r.estimated_mfu is not None else f"{'-':>6}"
        error = f"{r.error:+7.1%}" if r.error is not None else f"{'-':>7}"
        note = f"  ({r.note})" if r.note else ""
        lines.append(
            f"  {r.id:36} {r.model:13} {r.where:58} {r.cited_tokens_per_s:10,.0f} {est} "
            f"{r.cited_mfu:6.1%} {mfu} {error}  {r.sets or 'check only'}{note}"
        )
    return lines


def as_dict(row: CitedRow) -> dict[str, Any]:
    """The row with its error, for the result's JSON."""
    return {**asdict(row), "error": row.error}
