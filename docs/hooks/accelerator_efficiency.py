"""The accelerator catalog's efficiencies and the published runs they cite, rendered at build time
from workbench/estimator/accelerators.yaml.

A page holding `<!-- generated: accelerator-efficiency -->` gets two tables: each accelerator's
efficiency by precision and model size, with the runs it comes from (or the class it is taken
from), and every published run with its source, hardware, layout, batch, tokens/s per GPU and MFU.
"""

from __future__ import annotations

MARKER = "<!-- generated: accelerator-efficiency -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, efficiency_tables())
    return markdown


def efficiency_tables() -> str:
    from workbench.estimator.catalog import load_catalog, load_measurements
    from workbench.estimator.efficiency import band

    catalog, measured = load_catalog(), load_measurements()
    lines = [
        "| Accelerator | Precision | Model size | Efficiency | From |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, accel in catalog.items():
        for e in (e for e in accel.efficiency if not e.derived_from):
            runs = ", ".join(f"[{c}](#{c})" for c in e.cites)
            lines.append(
                f"| {name} | {', '.join(e.precisions)} | {band(e, accel.efficiency)} | "
                f"{e.value:.1%} | {e.basis or 'measured'} MFU of {runs} |"
            )
        taken: dict[str, list[str]] = {}
        for e in (e for e in accel.efficiency if e.derived_from):
            precisions = taken.setdefault(e.derived_from, [])
            precisions.extend(p for p in e.precisions if p not in precisions)
        lines += [
            f"| {name} | {', '.join(precisions)} | {source}'s bands | {source}'s values | "
            "no published figure for this class |"
            for source, precisions in taken.items()
        ]
    lines += [
        "",
        "| Run | Model | Hardware | Layout, batch | Precision | Tokens/s/GPU | MFU | Source |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in measured.values():
        peak = catalog[m.accelerator].peak(m.precision) or 0.0
        layout = (
            f"{m.parallelism} over {m.gpus * m.nodes}, {m.micro_batch} x "
            f"{m.shape['seq_len']} tokens x {m.grad_accum}"
            + (", compiled" if m.compile else "")
            + (
                f", {m.activation_checkpointing} checkpointing"
                if m.activation_checkpointing != "none"
                else ""
            )
        )
        lines.append(
            f'| <span id="{m.id}"></span>`{m.id}` | {m.model} | {m.hardware} | {layout} | '
            f"{m.precision} | {m.tokens_per_s_per_gpu:,.0f} | {m.mfu_at(peak):.1%} | "
            f"[{m.source}]({m.url}), {m.date} |"
        )
    return "\n".join(lines) + "\n"
