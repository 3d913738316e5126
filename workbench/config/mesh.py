"""The rank layout's one owner: how a run's ranks split over the mesh dimensions, and everything
derived from that (data-parallel size, world size, global batch, which modes shard, a rank's
coordinates). Every other module asks `ParallelDims` (torchtitan keeps the same arithmetic in a
class of that name).

The layout is a mesh of named dimensions, outermost first, as torchtitan names them:

    pp            pipeline stages (the data-parallel ranks are replicas of the whole pipeline)
    dp_replicate  data-parallel replicas (ddp, zero1; hsdp's groups)
    dp_shard      data-parallel ranks that shard parameters (zero2, zero3/fsdp; hsdp's shard groups)
    cp            context-parallel ranks: one batch, each rank a slice of every sequence (ring
                  attention); FSDP shards the parameters over dp_shard x cp together, as torchtitan
                  does
    tp            tensor-parallel ranks that split each matrix (Megatron style)

A rank's coordinates follow row-major order, so rank = (dp_index * cp + cp_index) * tp + tp_index:
the ranks of one TP group are neighbours, and those of a TP group and of a CP group see the same
batches and share a torch seed. mesh_checks.py refuses impossible layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.config.run_config import RunConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SHARDED = ("zero2", "zero3", "fsdp", "hsdp")
"""Parallelism modes that shard parameters over the dp_shard dimension (FSDP2)."""


INTERLEAVED = ("interleaved_1f1b", "zero_bubble")
"""Pipeline schedules that run several model chunks (virtual stages) per rank."""


def virtual_stages(cfg: RunConfig) -> int:
    """Model chunks per rank: cfg.pp_virtual_stages, or the schedule's own (2 interleaved, else
    1)."""
    if cfg.pp_virtual_stages:
        return cfg.pp_virtual_stages
    return 2 if cfg.pp_schedule in INTERLEAVED else 1


def shards(parallelism: str) -> bool:
    """Whether `parallelism` shards parameters (FSDP2) rather than replicating them."""
    return parallelism in SHARDED


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh dimensions; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, cfg: RunConfig, world_size: int | None = None) -> ParallelDims:
        """The layout of `cfg` over `world_size` ranks (default: cfg.num_processes; a multi-node
        launch passes the world it really has)."""
        world = cfg.num_processes if world_size is None else world_size
        dp = world // (cfg.tp * cfg.pp * cfg.cp)
        if cfg.parallelism == "hsdp" and cfg.dp_shard:
            replicate, shard = dp // cfg.dp_shard, cfg.dp_shard
        elif shards(cfg.parallelism):
            replicate, shard = 1, dp
        else:
            replicate, shard = dp, 1
        return cls(pp=cfg.pp, dp_replicate=replicate, dp_shard=shard, cp=cfg.cp, tp=cfg.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def sizes(self) -> dict[str, int]:
        """{'pp', 'dp_replicate', 'dp_shard', 'cp', 'tp'}: the sizes, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def ranks_per_stage(self) -> int:
        """Ranks in one pipeline stage (all ranks without a pipeline)."""
        return self.dp * self.cp * self.tp

    def global_batch(self, micro_batch_size: int, grad_accum_steps: int) -> int:
        """Samples per optimizer step over all ranks: only the data-parallel ranks see different
        ones."""
        return micro_batch_size * grad_accum_steps * self.dp

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major, 'pp' outermost, 'tp'
        innermost)."""
        coords = {}
        for name in reversed(MESH_DIMS):
            rank, coords[name] = divmod(rank, getattr(self, name))
        return {name: coords[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """The data-parallel coordinate: which batches `rank` sees (shared by a TP group, a CP group
        and a pipeline)."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

    def sizes_line(self) -> str:
        """The dimensions larger than 1, e.g. 'pp 2 × dp_shard 2', or 'one process'."""
        return (
            " × ".join(f"{name} {size}" for name, size in self.sizes.items() if size > 1)
            or "one process"
        )
