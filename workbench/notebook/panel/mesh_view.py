"""The rank layout as a picture: one cell per rank, a row per data-parallel index (the ranks of a
row see the same batches and form one tensor-parallel group), coloured by model replica and shaded
by shard; with pipeline parallelism, one column of rows per stage, left to right as the activations
flow."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from workbench.config.mesh import virtual_stages

if TYPE_CHECKING:
    from workbench.config import ParallelDims, RunConfig

REPLICA_HUES = (210, 30, 140, 280, 0, 90, 180, 330)
"""One hue per model replica (dp_replicate index); shards of one replica get lighter shades of
it."""


def _cell(rank: int, coords: dict[str, int], shards: int) -> str:
    hue = REPLICA_HUES[coords["dp_replicate"] % len(REPLICA_HUES)]
    light = 45 + (30 * coords["dp_shard"] // max(1, shards - 1) if shards > 1 else 0)
    title = ", ".join(f"{name} {index}" for name, index in coords.items())
    attrs = " ".join(f"data-{name.replace('_', '-')}='{index}'" for name, index in coords.items())
    return (
        f"<div class='wb-layout-rank' data-rank='{rank}' {attrs} title='rank {rank}: "
        f"{html.escape(title)}' style='width:3.2em;padding:0.3em 0;text-align:center;"
        f"border-radius:4px;color:white;font-size:85%;background:hsl({hue},65%,{light}%)'>"
        f"r{rank}</div>"
    )


def _stage_column(dims: ParallelDims, stage: int, chunks: int) -> str:
    """One pipeline stage's ranks (the whole mesh without pipeline parallelism): a row per
    data-parallel index, titled with the model stages the column holds."""
    tp, stages = dims.tp, dims.pp
    per_stage = dims.dp
    rows = []
    for dp_index in range(stage * per_stage, (stage + 1) * per_stage):
        # a row: one batch's ranks
        ranks = range(dp_index * tp * dims.cp, (dp_index + 1) * tp * dims.cp)
        cells = "".join(_cell(r, dims.coordinates(r), dims.dp_shard) for r in ranks)
        rows.append(f"<div class='wb-layout-row' style='display:flex;gap:3px'>{cells}</div>")
    held = ", ".join(str(stage + k * stages) for k in range(chunks))
    title = f"<small>stage{'s' * (chunks > 1)} {held}</small>" if stages > 1 else ""
    # one rank per row (no tp or cp) flows side by side, wrapping: 8 replicas are a line, not a
    # column
    flow = (
        "display:flex;flex-wrap:wrap;gap:3px 10px"
        if tp * dims.cp == 1 and stages == 1
        else "display:flex;flex-direction:column;gap:2px"
    )
    return (
        f"<div class='wb-layout-stage' data-stage='{stage}'>{title}<div style='{flow}'>"
        f"{''.join(rows)}</div></div>"
    )


def _legend(cfg: RunConfig, dims: ParallelDims, chunks: int) -> list[str]:
    """What the rows, columns, colours and shades of the picture mean, for those it has."""
    tp, shards, stages = dims.tp, dims.dp_shard, dims.pp
    split = f" and split each planned matrix {tp} ways" if tp > 1 else ""
    legend = [
        f"a row: ranks that see the same batches{split}"
        if tp * dims.cp > 1 or stages > 1
        else "each rank sees its own batches"
    ]
    if stages > 1:
        legend.append(
            f"columns: {stages} pipeline stages, each a slice of the model's blocks (activations "
            "flow left to right, micro-batch by micro-batch)"
        )
    if chunks > 1:
        legend.append(
            f"{cfg.pp_schedule}: each rank holds {chunks} model chunks, so the activations pass "
            f"every column {chunks} times (the model is cut into {stages * chunks} stages)"
        )
    replicas = dims.sizes["dp_replicate"]
    if replicas > 1:
        legend.append(f"colours: {replicas} model replicas (gradients all-reduced between them)")
    if shards > 1:
        legend.append(
            f"shades: {shards} shards of one replica (parameters/gradients/optimizer state split)"
        )
    return legend


def layout_html(cfg: RunConfig | None, problem: str = "") -> str:
    """The picture for `cfg`; none for a plan that can't run (the panel says why once, in its
    problem line)."""
    if cfg is None or problem:
        return "<div class='wb-layout' data-layout='impossible'><b>rank layout</b>: –</div>"
    dims = cfg.dims
    chunks = virtual_stages(cfg) if dims.pp > 1 else 1
    columns = [_stage_column(dims, stage, chunks) for stage in range(dims.pp)]
    arrow = "<div style='align-self:center'>→</div>"
    body = f"<div style='display:flex;gap:8px'>{arrow.join(columns)}</div>"
    shape = dims.sizes_line()
    legend = _legend(cfg, dims, chunks)
    return (
        f"<div class='wb-layout' data-layout='{html.escape(shape)}'><b>rank layout</b>: "
        f"{html.escape(shape)}{body}<small>{html.escape('; '.join(legend))}</small></div>"
    )
