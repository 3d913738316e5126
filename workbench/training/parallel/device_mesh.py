"""The run's one DeviceMesh, built from ParallelDims (torchtitan's ParallelDims.build_mesh): every
strategy, the estimator's trace and the hand-written reference loops take their mesh from
`build_mesh`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.config.mesh import ParallelDims, shards

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from workbench.config import RunConfig

DATA_DIMS = ("dp_replicate", "dp_shard", "cp")
"""The mesh dimensions the parameters are replicated or sharded over, outermost first (cp: the ranks
of a CP group see one batch, but hold the same parameters)."""


def mesh_dims(cfg: RunConfig, world: int) -> dict[str, int]:
    """The mesh's dimensions and sizes, outermost first ({} for replicated modes without tp, cp or
    pp: DDP and ZeRO-1 reduce over the default group).

    pp > 1: all of ('pp', 'dp_replicate', 'dp_shard', 'cp', 'tp'), size-1 ones included, each stage
    taking its sub-mesh. tp > 1 or cp > 1: those larger than 1 among dp_replicate, dp_shard, cp and
    tp (tp always when cp is 1), so the ranks of one TP group are neighbours: ('tp',), ('dp_shard',
    'tp'), ('dp_replicate', 'tp'), ('cp',), ('dp_shard', 'cp', 'tp'), ... Sharded modes:
    ('dp_shard',), or ('dp_replicate', 'dp_shard') for HSDP across groups."""
    sizes = ParallelDims.of(cfg, world).sizes
    if cfg.pp > 1:
        return dict(sizes)
    if cfg.tp > 1 or cfg.cp > 1:
        names = [n for n in (*DATA_DIMS, "tp") if sizes[n] > 1 or (n == "tp" and sizes["cp"] == 1)]
    elif shards(cfg.parallelism):
        names = [*(["dp_replicate"] * (sizes["dp_replicate"] > 1)), "dp_shard"]
    else:
        names = []
    return {name: sizes[name] for name in names}


def build_mesh(cfg: RunConfig, device_type: str, world: int) -> DeviceMesh | None:
    """The mesh of `cfg` over `world` ranks (mesh_dims), None where the mode needs none.
    Collective."""
    dims = mesh_dims(cfg, world)
    if not dims:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
