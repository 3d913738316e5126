"""The parameters, gradients and optimizer state every rank holds, from one rank's trace.

A trace runs as one rank; the others differ only in which slice of each tensor they hold. So the
trace records each tensor of model state once, with its global shape and (for a DTensor) its
placements over the named mesh dimensions, and any rank's bytes follow from its coordinates in the
mesh by DTensor's own arithmetic for local shapes: FSDP2's uneven dim-0 chunks, TP's column and row
slices, FSDP x TP's two-level split alike.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

log = logging.getLogger("workbench")
CATEGORIES = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class StatePiece:
    """One tensor shape of model state (`count` tensors of it), as a DTensor places it or whole."""

    category: str
    shape: tuple[int, ...]
    itemsize: int
    placements: tuple[tuple[str, Any], ...] = ()
    """(mesh dimension name, DTensor placement) per dimension of the tensor's mesh; () for a plain
    tensor."""
    count: int = 1


def pieces(category: str, tensors: Iterable[torch.Tensor]) -> list[StatePiece]:
    """The tensors' shapes and placements, identical ones counted together."""
    from torch.distributed.tensor import DTensor

    seen: Counter[tuple[Any, ...]] = Counter()
    for t in tensors:
        placed: tuple[tuple[str, Any], ...] = ()
        if isinstance(t, DTensor):
            names = t.device_mesh.mesh_dim_names or tuple(
                f"dim{i}" for i in range(t.device_mesh.ndim)
            )
            placed = tuple(zip(names, t.placements))
        seen[(tuple(t.shape), t.element_size(), placed)] += 1
    return [
        StatePiece(category, shape, size, placed, n) for (shape, size, placed), n in seen.items()
    ]


def state_pieces(strategy: Any) -> list[StatePiece]:
    """Parameters and the optimizer state of `strategy` (ZeRO-1: this rank's partition; see
    zero_partition)."""
    params = list(strategy.module.parameters())
    state = [
        v
        for s in strategy.local_optimizer().state.values()
        for v in s.values()
        if torch.is_tensor(v)
    ]
    return pieces("params", params) + pieces("optimizer", state)


def grad_pieces(strategy: Any) -> list[StatePiece]:
    return pieces("grads", (p.grad for p in strategy.module.parameters() if p.grad is not None))


def coordinates(mesh_dims: list[tuple[str, int]], rank: int) -> dict[str, int]:
    """`rank`'s index along each named mesh dimension (row-major, as init_device_mesh lays ranks
    out)."""
    coords = {}
    for name, size in reversed(mesh_dims):
        rank, coords[name] = divmod(rank, size)
    return coords


@lru_cache(maxsize=4096)
def _local_numel(
    shape: tuple[int, ...],
    placements: tuple[tuple[str, Any], ...],
    sizes: tuple[int, ...],
    coords: tuple[int, ...],
) -> int:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placed = [p for _, p in placements]
    try:
        local, _ = _compute_local_shape_and_global_offset(
            shape, sizes, list(coords), placed, skip_offset=True
        )
    except TypeError:  # a torch before skip_offset
        local, _ = _compute_local_shape_and_global_offset(shape, sizes, list(coords), placed)
    numel = 1
    for d in local:
        numel *= d
    return numel


def held_for(
    state: list[StatePiece], mesh_dims: list[tuple[str, int]], rank: int
) -> dict[str, int]:
    """Bytes by category that `rank` holds of `state` (traced on any rank of the same mesh)."""
    coords, sizes = coordinates(mesh_dims, rank), dict(mesh_dims)
    held = dict.fromkeys(CATEGORIES, 0)
    for piece in state:
        if piece.placements:
            names = tuple(name for name, _ in piece.placements)
            numel = _local_numel(
                piece.shape,
                piece.placements,
                tuple(sizes[n] for n in names),
                tuple(coords[n] for n in names),
            )
        else:
            numel = 1
            for d in piece.shape:
                numel *= d
        held[piece.category] += numel * piece.itemsize * piece.count
    return held


def checked_state(
    state: list[StatePiece], mesh_dims: list[tuple[str, int]], rank: int, measured: dict[str, int]
) -> list[StatePiece]:
    """`state` when it reproduces what the traced rank measured it holds; else [] (every rank is
    then given the traced rank's bytes), logged: a strategy whose state the shapes don't describe
    (say, flattened buffers)."""
    try:
        computed = held_for(state, mesh_dims, rank)
    except (KeyError, ValueError, TypeError, ImportError, AssertionError) as e:
        log.debug("model state by rank: %s", e)
        return []
    if computed != {k: measured.get(k, 0) for k in CATEGORIES}:
        log.debug(
            "model state by rank: the shapes give %s, the traced rank holds %s", computed, measured
        )
        return []
    return state
