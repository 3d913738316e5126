"""Directory lists given as an argument or as an ``os.pathsep``-separated environment variable.

Manifest directories (``extra_dirs``, ``WORKBENCH_MANIFESTS``) and mirrors (``mirrors``,
``WORKBENCH_DATA_MIRROR``) are both such lists, so they are read the same way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Union

__all__ = ["PathLike", "as_paths", "env_paths"]

PathLike = Union[str, "os.PathLike[str]"]


def as_paths(value: PathLike | Sequence[PathLike] | None) -> list[Path]:
    """``value`` as a list of user-expanded paths; None is the empty list."""
    # A lone path is accepted too: extra_dirs="manifests" must not mean ["m", "a", ...].
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    return [Path(p).expanduser() for p in value or ()]


def env_paths(var: str) -> list[Path]:
    """The paths listed in environment variable ``var``; blank entries are skipped."""
    return [Path(p).expanduser() for p in os.environ.get(var, "").split(os.pathsep) if p.strip()]
