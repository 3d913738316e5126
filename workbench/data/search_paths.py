"""Directory lists given as an argument or as an ``os.pathsep``-separated environment variable.

Manifest directories (``extra_dirs``, ``WORKBENCH_MANIFESTS``) and mirrors (``mirrors``,
``WORKBENCH_DATA_MIRROR``) are both such lists, so they are read the same way. A mirror may also
be an object-store URL (``s3://bucket/prefix``): it stays a string, since a Path would fold its
``//``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from workbench.storage.remote import is_remote

__all__ = ["Mirror", "PathLike", "as_mirrors", "as_paths", "env_mirrors", "env_paths"]

PathLike = Union[str, "os.PathLike[str]"]
Mirror = Union[Path, str]
"""A mirror: a local directory (Path), or an fsspec URL such as 's3://bucket/prefix' (str)."""


def as_paths(value: PathLike | Sequence[PathLike] | None) -> list[Path]:
    """``value`` as a list of user-expanded paths; None is the empty list."""
    # A lone path is accepted too: extra_dirs="manifests" must not mean ["m", "a", ...].
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    return [Path(p).expanduser() for p in value or ()]


def _split(text: str) -> list[str]:
    """An os.pathsep-separated list. Where the separator is ':', one followed by '//' belongs to a
    URL's scheme ('/data:s3://bucket/prefix' is two entries), so a local entry can't start with
    '//'."""
    separator = re.escape(os.pathsep) + ("(?!//)" if os.pathsep == ":" else "")
    return [p.strip() for p in re.split(separator, text) if p.strip()]


def env_paths(var: str) -> list[Path]:
    """The paths listed in environment variable ``var``; blank entries are skipped."""
    return [Path(p).expanduser() for p in os.environ.get(var, "").split(os.pathsep) if p.strip()]


def as_mirrors(value: PathLike | Sequence[PathLike] | None) -> list[Mirror]:
    """``value`` as mirrors: URLs with a scheme (s3://...) kept as they are, anything else a
    user-expanded local path."""
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    return [str(p).rstrip("/") if is_remote(str(p)) else Path(p).expanduser() for p in value or ()]


def env_mirrors(var: str) -> list[Mirror]:
    """The mirrors listed in environment variable ``var`` (local folders and URLs, os.pathsep
    between them); blank entries are skipped."""
    return as_mirrors(_split(os.environ.get(var, "")))
