"""Checkpoints written in the background (checkpoint_async): DCP's async_save copies the model and
optimizer state to host memory (pinned on a GPU) and writes it from a thread while training goes on.

The loop stalls only for that copy. At most one write is in flight: the next checkpoint, and the end
of the session, wait for it first. A thread per checkpoint waits for the write; then the ranks agree
that every rank's write succeeded, hash the files, and rank 0 writes the manifest and renames the
folder, as a synchronous save does. A crash before that leaves only checkpoints/.tmp-step_<N>, which
neither a resume nor load_model(step=N) ever takes.

The background collectives (DCP's planning, the ranks' agreement, the hashes) run over gloo groups
of their own: on the training's group they could interleave with the loop's collectives in a
different order on each rank.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.training.parallel import Strategy

log = logging.getLogger("workbench")
PARTS = ("model", "optim")


def writes_async(cfg: RunConfig, device: torch.device) -> tuple[bool, str]:
    """Whether checkpoints are written in the background, and why (said once, in the log)."""
    if cfg.checkpoint_async != "auto":
        return cfg.checkpoint_async == "on", f"checkpoint_async={cfg.checkpoint_async!r}"
    if device.type == "cuda":
        return True, (
            "checkpoint_async='auto' on GPUs: the state is copied to pinned host memory "
            "and written while the GPUs train"
        )
    return False, (
        "checkpoint_async='auto' on CPU: a background write would keep a copy of the "
        "state in the memory training uses and take the cores the ranks train on; 'on' "
        "writes in the background anyway"
    )


class Pending:
    """One checkpoint being written: the thread that finishes it, and what it raised."""

    def __init__(self, step: int, finish: Callable[[], None]) -> None:
        self.step, self.error = step, None
        # A daemon: a rank that fails while a write is in flight must still be able to exit.
        self._thread = threading.Thread(
            target=self._run, args=(finish,), daemon=True, name=f"checkpoint-step-{step}"
        )
        self._thread.start()

    def _run(self, finish: Callable[[], None]) -> None:
        try:
            finish()
        except BaseException as e:  # noqa: BLE001  (raised in the training thread by wait())
            self.error = e

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the write is complete (True), or `timeout_s` has passed (False: still in flight);
        its failure raised here, as a synchronous save raises it."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True


class BackgroundWriter:
    """The gloo groups and staging buffers of background checkpoint writes (one per part)."""

    def __init__(self, cfg: RunConfig, device: torch.device) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"
        self.groups: dict[str, Any] = {}
        if dist.is_initialized():  # collective: every rank builds the groups, in the same order
            timeout = timedelta(seconds=cfg.dist_timeout_s)
            self.groups = {part: dist.new_group(backend="gloo", timeout=timeout) for part in PARTS}
        # The copy is the stall: blocking, into buffers kept from one checkpoint to the next (pinned
        # on a GPU, so it runs at full PCIe speed); the write thread then reads only those.
        options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
        self.stagers = {part: DefaultStager(options) for part in PARTS}

    def start(self, strategy: Strategy, path: Path) -> list[Future]:
        """Stage this rank's parts of the checkpoint and start writing them into `path`: the
        futures of the writes (none for a rank that writes nothing)."""
        import torch.distributed.checkpoint as dcp

        parts, alone = strategy.checkpoint_parts()
        if alone or not self.groups:  # DCP warns from its thread that it runs without a group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        futures = []
        for key, state in parts.items():
            result = dcp.async_save(
                {key: state},
                checkpoint_id=str(path / key),
                no_dist=alone,
                process_group=self.groups.get(key),
                async_stager=self.stagers[key],
            )
            futures.append(getattr(result, "upload_completion", result))
        return futures

    def everyone(self, mine: Any) -> list[Any]:
        """`mine` from every rank, over a background group (the training's may be busy meanwhile);
        only once this rank's writes are done, so the group is free."""
        if not self.groups:
            return [mine]
        group = self.groups["model"]
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        return gathered

    def close(self) -> None:
        """Give back the staging buffers (pinned memory on a GPU); no write may be in flight."""
        for stager in self.stagers.values():
            stager.close()
