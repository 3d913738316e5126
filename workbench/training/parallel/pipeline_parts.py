"""The pieces of a pipeline rank: its place in the mesh, the names of its model chunks (virtual
stages, cut and made parallel by the recipe, apply.py) and the parameters tied across stages.

The chunks sit in one nn.ModuleList, so one optimizer steps them all; `full_name` turns the list's
parameter names back into the full model's, which checkpoints use, so any layout loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def dim_size(mesh: DeviceMesh, name: str) -> int:
    """The size of mesh dimension `name`, 1 where the mesh has none (a traced estimate's 2-D
    mesh)."""
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index(name)) if name in names else 1


def local_rank(mesh: DeviceMesh, name: str) -> int:
    return mesh.get_local_rank(name) if name in (mesh.mesh_dim_names or ()) else 0


def full_name(name: str) -> str:
    """A chunk list's parameter name as the full model has it:
    '1.blocks.3._checkpoint_wrapped_module.attn.q.weight' is 'blocks.3.attn.q.weight'."""
    name = name.split(".", 1)[1]
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names that share one parameter in the full model (e.g. ['tok.weight',
    'head.weight'])."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(names for names in groups.values() if len(names) > 1)


def held_prefixes(chunks: torch.nn.Module) -> list[str]:
    """What a rank holds, by module: 'blocks.3' for a repeated block, 'tok' for a top-level
    module."""
    held = set()
    for name, _ in chunks.named_parameters():
        parts = full_name(name).split(".")
        held.add(".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0])
    return sorted(held, key=lambda s: (s.split(".")[0], int(s.split(".")[1]) if "." in s else -1))


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient this rank holds for `p` (a DTensor's local shard), to reduce in place."""
    if p.grad is None:
        return None
    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


class TiedCopies:
    """Parameters the full model ties (char-gpt's embedding and head) held by several stages: one
    copy per stage, their gradients summed between the ranks holding them in one pipeline column
    (same data-parallel and tensor-parallel coordinates: their shards line up), so the copies stay
    equal and train as the tied one."""

    def __init__(
        self,
        chunks: torch.nn.Module,
        tied: list[list[str]],
        column: int,
        columns: int,
        stage_params: list[set[str]] | None,
        stages_of_rank: Any,
    ) -> None:
        params = {full_name(n): p for n, p in chunks.named_parameters()}
        mine = [[n for n in names if n in params] for names in tied]
        everyone = _holdings(
            tied, (column, [bool(m) for m in mine]), stage_params, stages_of_rank, columns
        )
        self.groups: list[tuple[Any, torch.nn.Parameter | None, bool]] = []
        """(process group of the holders, this rank's copy or None, whether this copy counts: in the
        gradient norm and in checkpoints, the first holder's)."""
        for i, names in enumerate(mine):
            for col in range(columns):
                ranks = [r for r, (c, held) in enumerate(everyone) if c == col and held[i]]
                if len(ranks) < 2:
                    continue
                # collective: every rank makes every group, in one order
                group = dist.new_group(ranks)
                if col == column:
                    rank = dist.get_rank()
                    self.groups.append(
                        (group, params[names[0]] if names else None, rank == ranks[0])
                    )

    def sum_gradients(self) -> None:
        for group, param, _ in self.groups:
            grad = local_grad(param) if param is not None else None
            if grad is not None:
                dist.all_reduce(grad, group=group)

    def uncounted(self) -> set[int]:
        """ids of the copies the gradient norm and the checkpoint leave out (counted once,
        elsewhere)."""
        return {id(p) for _, p, counts in self.groups if p is not None and not counts}


def _holdings(
    tied: list[list[str]],
    mine: tuple[int, list[bool]],
    stage_params: list[set[str]] | None,
    stages_of_rank: Any,
    columns: int,
) -> list[tuple[int, list[bool]]]:
    """Every rank's (column, which tied parameters it holds), gathered; a traced estimate, whose
    fake process group can't gather, names every stage's parameters instead (its Placement's
    stage_params)."""
    if stage_params is None:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone
    world = len(stage_params) // len(stages_of_rank(0)) * columns
    return [
        (
            rank % columns,
            [
                any(n in stage_params[s] for s in stages_of_rank(rank) for n in names)
                for names in tied
            ],
        )
        for rank in range(world)
    ]
