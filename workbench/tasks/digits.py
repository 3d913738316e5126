"""digits: an MLP classifier on scikit-learn's bundled 8x8 handwritten digits (1,797 images,
offline)."""

from __future__ import annotations

import contextlib
import gzip
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from workbench.tasks.base import Task
from workbench.tasks.options import TaskOption
from workbench.utils.files import atomic_write_bytes

if TYPE_CHECKING:
    from workbench.config import RunConfig

# The split must not move with cfg.seed, or eval numbers of different seeds would not be comparable.
_SPLIT_SEED = 1234


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images scaled to [0, 1] as float32 of shape (n, 64), labels as int64), via the digits
    manifest."""
    from workbench import data

    resolved = data.resolve("digits", progress=False)
    name, path = next(iter(resolved.files.items()))
    table = _parsed_table(path, resolved.sha256.get(name, ""))
    return table[:, :-1] / 16.0, table[:, -1].astype(np.int64)


def _parsed_table(path: Path, sha256: str) -> np.ndarray:
    """The CSV as a float32 table, kept beside it as .npy under its digest: parsing takes 18 ms,
    which every rank of every launch would pay again (loading the .npy: under 1 ms)."""
    parsed = path.with_name(f".{path.name}.{sha256[:16]}.npy")
    if sha256:
        with contextlib.suppress(OSError, ValueError):  # not there yet, or cut short: parsed again
            return np.load(parsed, allow_pickle=False)
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    if sha256:
        buffer = io.BytesIO()
        np.save(buffer, table, allow_pickle=False)
        with contextlib.suppress(OSError):  # a read-only cache still loads, parsing each time
            atomic_write_bytes(parsed, buffer.getvalue())
    return table


class DigitsTask(Task):
    name = "digits"
    option_specs = (
        TaskOption("hidden", int, 128, "width of the MLP's two hidden layers", min=1, max=65536),
        TaskOption(
            "dropout",
            float,
            0.1,
            "dropout after each hidden layer",
            min=0.0,
            max=1.0,
            max_exclusive=True,
        ),
        TaskOption(
            "eval_fraction",
            float,
            0.2,
            "share of the 1,797 images held out for evaluation (the same split for every seed)",
            min=0.0,
            max=1.0,
            min_exclusive=True,
            max_exclusive=True,
        ),
    )

    def datasets(self, cfg: RunConfig) -> list[str]:
        return ["digits"]

    def build_model(self, cfg: RunConfig) -> nn.Module:
        o = self.options(cfg)
        return nn.Sequential(
            nn.Linear(64, o["hidden"]),
            nn.GELU(),
            nn.Dropout(o["dropout"]),
            nn.Linear(o["hidden"], o["hidden"]),
            nn.GELU(),
            nn.Dropout(o["dropout"]),
            nn.Linear(o["hidden"], 10),
        )

    def build_datasets(self, cfg: RunConfig) -> tuple[TensorDataset, TensorDataset]:
        x, y = load_digits_arrays()
        order = np.random.default_rng(_SPLIT_SEED).permutation(len(y))
        n_eval = int(len(y) * self.options(cfg)["eval_fraction"])
        ev, tr = order[:n_eval], order[n_eval:]
        return (
            TensorDataset(torch.from_numpy(x[tr]), torch.from_numpy(y[tr])),
            TensorDataset(torch.from_numpy(x[ev]), torch.from_numpy(y[ev])),
        )

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x, y = batch
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        accuracy = (logits.argmax(dim=-1) == y).float().mean()
        return loss, {"accuracy": accuracy}

    def flops_per_sample(self, cfg: RunConfig, model: nn.Module) -> float:
        return 6.0 * sum(p.numel() for p in model.parameters())
