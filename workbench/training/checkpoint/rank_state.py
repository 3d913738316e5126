"""Each rank's own part of a checkpoint, step_<N>/rank_<r>.pt: the states of every RNG a step may
draw from (Python, torch, NumPy, CUDA) and the loss scaler's, saved as plain tensors and numbers so
that they load with weights_only=True. A resume puts them back on the rank that wrote them; a rank
the checkpoint has no file for (more ranks than wrote it) starts with fresh random states.
"""

from __future__ import annotations

import io
import logging
import random
from typing import Any

import numpy as np
import torch

from workbench.storage.store_path import Location, StorePath
from workbench.training.checkpoint.failures import write_file

log = logging.getLogger("workbench")


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG a step may draw from, as plain tensors and numbers (loadable with
    weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def save_rank_state(path: Location, device: torch.device, scaler: Any) -> None:
    """This rank's RNG states and its loss scaler's state (None without one) into `path`. Saved to
    memory, then written: torch.save into a path turns a full disk into a RuntimeError of its zip
    writer ('unexpected pos'), where a plain write raises ENOSPC naming the file."""
    buffer = io.BytesIO()
    torch.save(
        {"rng": rng_state(device), "scaler": scaler.state_dict() if scaler else None}, buffer
    )
    write_file(path, buffer.getvalue())


def load_rank_state(
    ckpt: Location, rank: int, saved_world: int | None, device: torch.device, scaler: Any
) -> None:
    """Put back what rank `rank` saved in `ckpt` (written by `saved_world` ranks). A rank beyond
    those starts with fresh random states; a missing file of one of them fails the resume."""
    mine = ckpt / f"rank_{rank}.pt"
    if mine.exists():
        # a store's object is read whole: torch.load wants a seekable file
        source = io.BytesIO(mine.read_bytes()) if isinstance(mine, StorePath) else mine
        rank_state = torch.load(source, weights_only=True)
        set_rng_state(rank_state["rng"], device)
        if scaler is not None and rank_state.get("scaler"):
            scaler.load_state_dict(rank_state["scaler"])
    elif rank < (saved_world or 0):
        raise FileNotFoundError(
            f"{mine}: the checkpoint was saved by {saved_world} ranks but has no state for rank "
            f"{rank}"
        )
    else:
        # a rank the checkpoint had no state for: what that changes (dropout) note_dropout
        # (resume.py) said once
        log.debug(
            "[rank %d] %s was saved by %s rank(s): this rank starts with fresh random states",
            rank,
            ckpt.name,
            saved_world,
        )
