"""Small corrections to torch.distributed that both sides use (a leaf module)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch.distributed as dist

FORKED_RANKS = "WORKBENCH_FORKED_RANKS"
"""Set by the fork-mode supervisor: the ranks are forks of the caller's process (see rank.py on
OpenMP)."""


@contextlib.contextmanager
def single_process_dcp(alone: bool = False) -> Iterator[None]:
    """DCP warns when it runs without a process group (or with `no_dist`: `alone`); one process
    saving or loading alone is what's meant."""
    with warnings.catch_warnings():
        if alone or not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
