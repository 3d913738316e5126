"""Where manifests are found: the search directories, user overrides, listing and loading by name.

What a manifest holds and how one file is validated is :mod:`workbench.data.manifest`'s concern.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.data.errors import ManifestError
from workbench.data.manifest import Manifest, parse_manifest
from workbench.data.search_paths import PathLike, as_paths, env_paths

__all__ = ["MANIFEST_DIR", "list_manifests", "load_manifest", "manifest_dirs"]

log = logging.getLogger("workbench")


def _builtin_manifest_dir() -> Path:
    """data-manifests/ of a source checkout (editable install), else the copy a wheel ships."""
    checkout = Path(__file__).resolve().parents[2] / "data-manifests"
    if checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parents[1] / "builtin_manifests"


#: Built-in manifests live beside the package, at the repository root.
MANIFEST_DIR = _builtin_manifest_dir()


def manifest_dirs(extra_dirs: Sequence[PathLike] | None = None) -> list[Path]:
    """Directories searched for manifests, highest priority first.

    ``extra_dirs``, then ``WORKBENCH_MANIFESTS`` (``os.pathsep``-separated), then
    the built-in ``data-manifests/``.
    """
    dirs = as_paths(extra_dirs) + env_paths("WORKBENCH_MANIFESTS") + [MANIFEST_DIR]
    unique: list[Path] = []
    for d in dirs:
        if d.resolve() not in (u.resolve() for u in unique):
            unique.append(d)
    return unique


_warned: set[tuple[str, ...]] = set()


def _warn_once(key: tuple[str, ...], message: str, *args: Any) -> None:
    # Manifests are looked up on every resolve(); one warning per situation is enough.
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _manifest_paths(extra_dirs: Sequence[PathLike] | None) -> dict[str, Path]:
    """The winning manifest file for each dataset name."""
    found: dict[str, list[Path]] = {}
    for d in manifest_dirs(extra_dirs):
        if not d.is_dir():
            _warn_once(
                ("missing-dir", str(d)), "data manifest directory %s does not exist; ignoring it", d
            )
            continue
        for p in sorted(d.iterdir()):
            if p.suffix in (".yaml", ".yml") and p.is_file():
                found.setdefault(p.stem, []).append(p)
    for name, paths in found.items():
        if len(paths) > 1:
            _warn_once(
                ("override", *map(str, paths)),
                "data manifest %r: using %s, which overrides %s",
                name,
                paths[0],
                ", ".join(map(str, paths[1:])),
            )
    return {name: paths[0] for name, paths in found.items()}


def list_manifests(extra_dirs: Sequence[PathLike] | None = None) -> list[Manifest]:
    """Every known manifest (user ones overriding built-ins), sorted by name."""
    return [parse_manifest(p) for _, p in sorted(_manifest_paths(extra_dirs).items())]


def load_manifest(name: str, extra_dirs: Sequence[PathLike] | None = None) -> Manifest:
    """The manifest of dataset ``name``; ManifestError lists the known names if there is none."""
    paths = _manifest_paths(extra_dirs)
    if name not in paths:
        known = ", ".join(sorted(paths)) or "(none)"
        searched = ", ".join(map(str, manifest_dirs(extra_dirs)))
        raise ManifestError(
            f"unknown dataset {name!r}; known datasets: {known} "
            f"(manifests are read from: {searched})"
        )
    return parse_manifest(paths[name])
