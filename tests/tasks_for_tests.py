"""Tasks used by the tests: tiny, deterministic, and able to fail, hang or be slow on request.

Behaviour is driven by task_options so it also works in `workbench train` subprocesses
(task: "tasks_for_tests:TinyRegression" with this directory on PYTHONPATH).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

import workbench as wb
from workbench.tasks.char_gpt import CharGPTTask


class SlowSamples(torch.utils.data.Dataset):
    """A dataset that takes `delay_s` to produce each sample, as a slow disk or decoder would."""

    def __init__(self, inner: TensorDataset, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        import time

        time.sleep(self.delay_s)
        return self.inner[i]


class TinyRegression(wb.Task):
    name = "tiny-regression"
    default_options: dict[str, Any] = {
        "n": 512,
        "dropout": 0.0,
        "fail_rank": None,
        "fail_at_call": 0,  # raise in loss() on that rank at that call (1-based)
        "kill_rank": None,  # ... or SIGKILL that rank there, as the OOM killer would
        "slow_s": 0.0,  # sleep per loss call, to make a run long enough to stop
        "slow_rank": None,  # ... on that rank only (a straggler)
        "slow_data_s": 0.0,  # sleep per training sample fetched (an input-bound run)
        "nan_rank": None,
        "nan_at_call": 0,  # that rank's loss becomes NaN at that call
        "hang_rank": None,
        "hang_at_call": 0,  # that rank sleeps forever in that call, as a stuck user step would
        "crash_marker": None,  # with fail_rank/fail_at_call: fail only while this file is absent
    }

    def __init__(self) -> None:
        self.calls = 0

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        o = self.options(cfg)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 32),
            torch.nn.GELU(),
            torch.nn.Dropout(o["dropout"]),
            torch.nn.Linear(32, 1),
        )

    def build_datasets(self, cfg: wb.RunConfig) -> tuple[TensorDataset, TensorDataset]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.options(cfg)["n"], 8, generator=g)
        y = (x * torch.linspace(-1, 1, 8)).sum(1, keepdim=True) + 0.1 * torch.randn(
            len(x), 1, generator=g
        )
        train = TensorDataset(x, y)
        slow = self.options(cfg)["slow_data_s"]
        return (SlowSamples(train, slow) if slow else train), TensorDataset(x[:64], y[:64])

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        o = self.options_cache
        rank = int(os.environ.get("RANK", "0"))
        if o["fail_rank"] == rank and self.calls == o["fail_at_call"]:
            marker = Path(o["crash_marker"]) if o["crash_marker"] else None
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.touch()
                raise ValueError(f"injected failure on call {self.calls}")
        if o["hang_rank"] == rank and self.calls == o["hang_at_call"]:
            import time

            time.sleep(10**6)
        if o["kill_rank"] == rank and self.calls == o["fail_at_call"]:
            os.kill(os.getpid(), 9)
        if o["slow_s"] and o["slow_rank"] in (None, rank):
            import time

            time.sleep(o["slow_s"])
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if o["nan_rank"] == rank and self.calls == o["nan_at_call"]:
            loss = loss * float("nan")
        return loss

    def options(self, cfg: wb.RunConfig) -> dict[str, Any]:
        self.options_cache = super().options(cfg)
        return self.options_cache


class TinyBlocks(TinyRegression):
    """TinyRegression's data through a stack of residual blocks in a ModuleList: the shape sharding and
    activation checkpointing work on (each block is a shard unit)."""

    name = "tiny-blocks"
    default_options: dict[str, Any] = {**TinyRegression.default_options, "width": 32, "blocks": 3}

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        o = self.options(cfg)
        return BlockStack(o["width"], o["blocks"], o["dropout"])


class Block(torch.nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class BlockStack(torch.nn.Module):
    def __init__(self, width: int, blocks: int, dropout: float) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(Block(width, dropout) for _ in range(blocks))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class SkippedByDynamo(torch.nn.Module):
    """A model dynamo won't trace a frame of (torch._dynamo.disable): compiling it compiles nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)
        )

    @torch._dynamo.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UncompilableRegression(TinyRegression):
    name = "uncompilable-regression"

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        return SkippedByDynamo()


class HeldAtStart(TinyRegression):
    """TinyRegression whose construction waits, in the processes $WB_TEST_HOLD names ('launcher': the process
    that launches, 'ranks': every rank), until the file $WB_TEST_HOLD_DIR/go exists (120 s at most). Each held
    process first writes held-launcher or held-rank_<r> there, holding its pid. A run held in its setup, before
    any heartbeat, for as long as a test needs: the ranks build their task before the trainer starts."""

    name = "held-at-start"

    def __init__(self) -> None:
        super().__init__()
        where, folder = os.environ.get("WB_TEST_HOLD"), os.environ.get("WB_TEST_HOLD_DIR")
        rank = os.environ.get("RANK")
        if not (where and folder) or (where == "launcher") != (rank is None):
            return
        import time

        role = "launcher" if rank is None else f"rank_{rank}"
        hold = Path(folder)
        (hold / f".held-{role}").write_text(str(os.getpid()))
        (hold / f".held-{role}").rename(hold / f"held-{role}")  # whole, or not there
        deadline = time.monotonic() + 120
        while not (hold / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


class SpikedCharGPT(CharGPTTask):
    """char-gpt whose loss is multiplied by `factor` (1e6) at each rank's `spike_at`-th training loss: fp16's
    scaled gradients overflow there, so every rank's scaler must skip that update and halve its scale. A NaN
    `offset` instead makes that loss not finite and leaves its gradients finite."""

    def __init__(self, spike_at: int, factor: float = 1e6, offset: float = 0.0) -> None:
        super().__init__()
        self.spike_at, self.factor, self.offset, self.losses = spike_at, factor, offset, 0

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = super().loss(model, batch)
        if torch.is_grad_enabled():
            self.losses += 1
            if self.losses == self.spike_at:
                return loss * self.factor + self.offset
        return loss
