"""Verification of the cache: re-hash cached files against their manifests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from workbench.data.cache import DatasetCache, cache_dir, sha256_file
from workbench.data.manifest_lookup import list_manifests, load_manifest
from workbench.data.search_paths import PathLike

__all__ = ["FileCheck", "verify"]


def _short(digest: str | None) -> str:
    return f"{digest[:12]}…" if digest else "?"


@dataclass(frozen=True)
class FileCheck:
    """The state of one cached file, as found by :func:`verify`."""

    dataset: str
    path: str
    status: Literal["ok", "missing", "corrupt"]
    expected_sha256: str | None
    actual_sha256: str | None
    location: Path

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __str__(self) -> str:
        label = f"{self.dataset}/{self.path}"
        if self.status == "ok":
            return f"{label}  ok"
        if self.status == "missing":
            return f"{label}  missing ({self.location})"
        digests = f"expected {_short(self.expected_sha256)}, got {_short(self.actual_sha256)}"
        return f"{label}  corrupt ({digests}) {self.location}"


def verify(
    name: str | None = None,
    *,
    extra_dirs: Sequence[PathLike] | None = None,
    cache: PathLike | None = None,
) -> list[FileCheck]:
    """Re-hash cached files of dataset ``name`` (None: every manifest) against their manifests.

    Nothing is fetched or changed. A synthetic file without a sha256 in its
    manifest counts as missing until resolve() has generated it from the current spec.
    """
    if name is not None:
        manifests = [load_manifest(name, extra_dirs)]
    else:
        manifests = list_manifests(extra_dirs)
    cache_root = Path(cache).expanduser() if cache is not None else cache_dir()
    checks = []
    for m in manifests:
        entry = DatasetCache(cache_root, m.name, m.version)
        for spec in m.files:
            location = entry.root / spec.path
            expected = entry.expected_sha256(spec)
            if not location.is_file() or expected is None:
                checks.append(FileCheck(m.name, spec.path, "missing", expected, None, location))
                continue
            actual = sha256_file(location)
            status = "ok" if actual == expected else "corrupt"
            checks.append(FileCheck(m.name, spec.path, status, expected, actual, location))
    return checks
