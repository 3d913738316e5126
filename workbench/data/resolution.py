"""Resolution: a manifest's files, verified, in the cache.

Each file comes from the first place that has a verified copy: the cache, the installed
package, a mirror (a local folder, or an object store's URL such as s3://bucket/prefix), a URL,
or a generator. The cache's layout and state are :mod:`workbench.data.cache`'s concern; this
module decides where to look and in what order.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any, BinaryIO

from workbench.data.archives import extract_archive
from workbench.data.cache import (
    TMP_PREFIX,
    Copied,
    DatasetCache,
    cache_dir,
    copy_to_temp,
    dataset_lock,
    sha256_file,
)
from workbench.data.errors import DataUnavailableError, IntegrityError, ManifestError, one_line
from workbench.data.generators import GENERATORS
from workbench.data.manifest import FileSpec, Manifest, relative_path
from workbench.data.manifest_lookup import load_manifest
from workbench.data.search_paths import Mirror, PathLike, as_mirrors, env_mirrors
from workbench.storage.remote import StorageError, filesystem
from workbench.utils.files import mkstemp_like_open

__all__ = ["ResolvedData", "fetch", "reset_used_datasets", "resolve", "used_datasets"]

log = logging.getLogger("workbench")

_DOWNLOAD_TIMEOUT_S = 30
_OFFLINE_REASON = "skipped: offline (offline=True or WORKBENCH_OFFLINE=1)"


@dataclass(frozen=True)
class ResolvedData:
    """A dataset whose files are verified and present in the cache."""

    name: str
    version: str
    root: Path
    files: dict[str, Path]
    manifest: Manifest
    sha256: dict[str, str] = field(default_factory=dict)
    #: Where each file came from this time: "cache", a mirror path, a URL, ...
    origins: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """JSON-able record for the run directory: what data exactly was used."""
        return {
            "name": self.name,
            "version": self.version,
            "source": self.manifest.source,
            "files": dict(self.sha256),
        }

    def __getitem__(self, path: str) -> Path:
        """A declared file, or a file extracted from one of its archives."""
        if path in self.files:
            return self.files[path]
        relative = relative_path(path)
        if relative is not None and (self.root / relative).exists():
            return self.root / relative
        raise KeyError(f"{self.name} has no file {path!r}; declared files: {', '.join(self.files)}")


def _download_reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return one_line(e.reason if isinstance(e.reason, BaseException) else str(e.reason))
    return one_line(e)


@dataclass
class _Attempt:
    """One place a file was looked for, and why it was not used."""

    where: str
    reason: str
    actual_sha256: str | None = None
    corrupt: bool = False


def _corrupt(where: str, sha: str, size: int) -> _Attempt:
    """A downloaded or generated copy that doesn't match: its digest and size are the copy's own
    (what came over the network, or what the generator wrote)."""
    return _Attempt(where, f"corrupt: got sha256 {sha} ({size:,} bytes)", sha, corrupt=True)


def _local_mismatch(where: str, path: Path, which: str) -> _Attempt:
    """A local file (a mirror's, a package's, a file:// URL's) that doesn't match: named, with what
    differs and where to look, but not its digest or size. A manifest can name any local file, and
    its message travels (regress reports, CI logs): it must not disclose what the file holds."""
    return _Attempt(
        where,
        f"corrupt: its {which} differs from the manifest's (compare `sha256sum {path}` with "
        "it); replace or remove that file",
        corrupt=True,
    )


def _which_differs(spec: FileSpec, size: int) -> str:
    """'size' or 'sha256': what of a local copy differs from `spec` (size first: it is cheaper)."""
    return "size" if spec.size is not None and size != spec.size else "sha256"


def _store_reason(e: BaseException) -> str:
    """Why an object store didn't serve a file, with the fix for what a user can fix."""
    if isinstance(e, PermissionError):
        return (
            f"access denied ({one_line(e)}); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
            "AWS_PROFILE to keys that may read it"
        )
    return f"{type(e).__name__}: {one_line(e)} (check AWS_ENDPOINT_URL and that the store is up)"


def _file_url_path(url: str) -> Path | None:
    """The local path a file:// URL names; None for any other URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "file":
        return None
    return Path(urllib.request.url2pathname(parts.path))


class _Resolver:
    """Resolves one manifest's files into the cache; runs under the dataset lock."""

    def __init__(
        self, manifest: Manifest, cache: Path, mirrors: list[Mirror], offline: bool, progress: bool
    ) -> None:
        self.m = manifest
        self.entry = DatasetCache(cache, manifest.name, manifest.version)
        self.root = self.entry.root
        self.mirrors = mirrors
        self.offline = offline
        self.progress = progress

    def run(self) -> ResolvedData:
        self.root.mkdir(parents=True, exist_ok=True)
        self.entry.remove_stale_temps(s.path for s in self.m.files)
        shas: dict[str, str] = {}
        origins: dict[str, str] = {}
        for spec in self.m.files:
            target = self.root / spec.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shas[spec.path], origins[spec.path] = self._file(spec, target)
            if spec.extract and not self.entry.is_extracted(spec.path, shas[spec.path]):
                log.info("data %s: extracting %s", self.m.name, spec.path)
                extract_archive(
                    target, self.root, protected={s.path for s in self.m.files}, manifest=self.m
                )
                self.entry.record_extracted(spec.path, shas[spec.path])
        files = {s.path: self.root / s.path for s in self.m.files}
        return ResolvedData(self.m.name, self.m.version, self.root, files, self.m, shas, origins)

    def _label(self, spec: FileSpec) -> str:
        return f"{self.m.name}/{spec.path}"

    def _cached(self, spec: FileSpec, target: Path, attempts: list[_Attempt]) -> str | None:
        """The sha256 of a good cached copy; else None, with why appended to attempts."""
        expected = self.entry.expected_sha256(spec)
        if not target.is_file() or expected is None:
            why = "not present" if not target.exists() else "not generated from this spec"
            attempts.append(_Attempt(f"cache {target}", why))
            return None
        sha = sha256_file(target)
        size = target.stat().st_size
        if sha == expected and spec.size in (None, size):
            log.debug("data %s: cache hit %s", self._label(spec), target)
            return sha
        log.warning(
            "data %s: cached file %s is corrupt (expected sha256 %s, got %s); fetching it again",
            self._label(spec),
            target,
            expected,
            sha,
        )
        attempts.append(_corrupt(f"cache {target}", sha, size))
        return None

    def _file(self, spec: FileSpec, target: Path) -> tuple[str, str]:
        attempts: list[_Attempt] = []
        cached = self._cached(spec, target, attempts)
        if cached is not None:
            return cached, "cache"
        if self.m.source == "synthetic":
            return self._generate(spec, target, attempts)
        if self.m.source == "package":
            found = _package_file(spec)
            if isinstance(found, Path):
                where = f"package {spec.package} ({found})"
                result = self._from_local(spec, target, found, where)
                if isinstance(result, str):
                    return result, where
                attempts.append(result)
            else:
                attempts.append(_Attempt(f"package {spec.package}", found))
        found_in_mirror = self._from_mirrors(spec, target, attempts)
        if found_in_mirror is not None:
            return found_in_mirror
        for url in spec.urls:
            if self.offline:
                attempts.append(_Attempt(url, _OFFLINE_REASON))
                continue
            result = self._from_url(spec, target, url)
            if isinstance(result, str):
                return result, url
            attempts.append(result)
        raise self._failure(spec, attempts)

    def _copy(self, src: BinaryIO, spec: FileSpec, target: Path) -> Copied:
        return copy_to_temp(
            src, target.parent, limit=spec.size, desc=self._label(spec), progress=self.progress
        )

    def _accept(
        self, spec: FileSpec, target: Path, copied: Copied, where: str, local: Path | None = None
    ) -> str | _Attempt:
        """Move a verified temp file into the cache, or reject it. `local`: the local file it was
        copied from, whose digest and size a rejection doesn't show."""
        if copied.tmp is None:
            # the manifest's size, not the file's: nothing of a local file is disclosed
            return _Attempt(
                where,
                f"corrupt: more than the expected {spec.size:,} bytes (stopped reading)",
                corrupt=True,
            )
        if (spec.size is not None and copied.size != spec.size) or (
            spec.sha256 and copied.sha256 != spec.sha256
        ):
            copied.tmp.unlink()
            if local is not None:
                which = _which_differs(spec, copied.size)
                log.warning(
                    "data %s: rejected %s (its %s differs from the manifest's)",
                    self._label(spec),
                    where,
                    which,
                )
                return _local_mismatch(where, local, which)
            log.warning(
                "data %s: rejected %s (expected sha256 %s, got %s)",
                self._label(spec),
                where,
                spec.sha256,
                copied.sha256,
            )
            return _corrupt(where, copied.sha256, copied.size)
        os.replace(copied.tmp, target)
        return copied.sha256

    def _from_local(self, spec: FileSpec, target: Path, src: Path, where: str) -> str | _Attempt:
        try:
            size = src.stat().st_size
            if spec.size is not None and size != spec.size:
                # neither copied nor hashed: it is known to be wrong
                return _local_mismatch(where, src, "size")
            with open(src, "rb") as f:
                copied = self._copy(f, spec, target)
        except OSError as e:
            return _Attempt(where, one_line(e))
        result = self._accept(spec, target, copied, where, local=src)
        if isinstance(result, str):
            log.info("data %s: copied from %s", self._label(spec), src)
        return result

    def _from_mirrors(
        self, spec: FileSpec, target: Path, attempts: list[_Attempt]
    ) -> tuple[str, str] | None:
        """(sha256, mirror file) of the first good mirror copy; failures go to attempts."""
        if not self.mirrors:
            attempts.append(
                _Attempt("mirrors", "none configured (WORKBENCH_DATA_MIRROR is not set)")
            )
        name = self.m.name
        for mirror in self.mirrors:
            if isinstance(mirror, str):
                found = self._from_store(spec, target, mirror, attempts)
                if found is not None:
                    return found
                continue
            # <name>/<path> is the documented layout; <name>/<version>/<path> lets a copied
            # cache serve as a mirror.
            candidates = [mirror / name / spec.path, mirror / name / self.m.version / spec.path]
            hit = next((c for c in candidates if c.is_file()), None)
            if hit is None:
                missing = "" if mirror.is_dir() else " (the mirror directory does not exist)"
                attempts.append(_Attempt(f"mirror {mirror}", f"has no {name}/{spec.path}{missing}"))
                continue
            result = self._from_local(spec, target, hit, f"mirror {hit}")
            if isinstance(result, str):
                return result, str(hit)
            attempts.append(result)
        return None

    def _from_store(
        self, spec: FileSpec, target: Path, url: str, attempts: list[_Attempt]
    ) -> tuple[str, str] | None:
        """(sha256, object URL) of a good copy in the object-store mirror `url`, laid out as a local
        mirror; else None, with why appended to attempts. Its copy is verified like a download:
        a mismatch shows the copy's digest, which is the store's, not a local file's."""
        name = self.m.name
        try:
            fs, root = filesystem(url)
        except StorageError as e:
            attempts.append(_Attempt(f"mirror {url}", one_line(e)))
            return None
        for relative in (f"{name}/{spec.path}", f"{name}/{self.m.version}/{spec.path}"):
            where = f"{url}/{relative}"
            try:
                with fs.open(f"{root.rstrip('/')}/{relative}", "rb") as src:
                    copied = self._copy(src, spec, target)
            except (FileNotFoundError, IsADirectoryError):
                continue
            except Exception as e:  # botocore's errors (endpoint, credentials) aren't OSErrors
                attempts.append(_Attempt(f"mirror {where}", _store_reason(e)))
                return None  # the store itself failed: the next layout would fail alike
            result = self._accept(spec, target, copied, f"mirror {where}")
            if isinstance(result, str):
                log.info("data %s: copied from %s", self._label(spec), where)
                return result, where
            attempts.append(result)
            return None
        attempts.append(_Attempt(f"mirror {url}", f"has no {name}/{spec.path}"))
        return None

    def _from_url(self, spec: FileSpec, target: Path, url: str) -> str | _Attempt:
        log.info("data %s: downloading %s", self._label(spec), url)
        request = urllib.request.Request(url, headers={"User-Agent": "workbench-data"})
        try:
            with urllib.request.urlopen(request, timeout=_DOWNLOAD_TIMEOUT_S) as response:
                copied = self._copy(response, spec, target)
        except (OSError, HTTPException, ValueError) as e:  # URLError and timeouts are OSErrors
            return _Attempt(url, _download_reason(e))
        return self._accept(spec, target, copied, url, local=_file_url_path(url))

    def _generate(self, spec: FileSpec, target: Path, attempts: list[_Attempt]) -> tuple[str, str]:
        params = spec.generator_spec()["params"]
        where = f"generator {spec.generator}(seed={spec.seed})"
        log.info("data %s: generating with %s", self._label(spec), where)
        fd, name = mkstemp_like_open(target.parent, prefix=TMP_PREFIX)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                GENERATORS[spec.generator].write(out, params, spec.seed)  # type: ignore[index]
            sha, size = sha256_file(tmp), tmp.stat().st_size
        except ValueError as e:
            tmp.unlink(missing_ok=True)
            raise ManifestError(
                f"{self.m.path}: cannot generate {spec.path}: {e}", self.m.path
            ) from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        result = self._accept(spec, target, Copied(tmp, sha, size), where)
        if isinstance(result, _Attempt):
            raise self._failure(spec, [*attempts, result])
        self.entry.record_generated(spec, sha)
        return sha, where

    def _failure(self, spec: FileSpec, attempts: list[_Attempt]) -> Exception:
        tried = "\n".join(f"  - {a.where}: {a.reason}" for a in attempts)
        corrupt = [a for a in attempts if a.corrupt]
        if corrupt:
            size = f" ({spec.size:,} bytes)" if spec.size is not None else ""
            return IntegrityError(
                f"{self._label(spec)}: no copy matches the manifest, so none was used.\n"
                f"  expected sha256 {spec.sha256 or '(not declared)'}{size}, per {self.m.path}\n"
                f"Tried:\n{tried}",
                expected=spec.sha256,
                actual=corrupt[0].actual_sha256,
                location=corrupt[0].where,
            )
        name, cache = self.m.name, self.entry.cache
        lines = [
            f"dataset {name!r} is not available: no copy of {spec.path} could be found.",
            f"Tried:\n{tried}",
            "To use it without internet access, either:",
            (
                "  - put the file in a mirror directory and set WORKBENCH_DATA_MIRROR to that "
                "directory"
            ),
            (
                "    (WORKBENCH_DATA_MIRROR=/path/to/mirror, holding "
                f"/path/to/mirror/{name}/{spec.path}; an object store's URL, "
                "s3://bucket/prefix, is a mirror too), or"
            ),
            f"  - run `workbench data fetch {name}` on a machine with internet access and copy its",
            f"    cache directory {name}/ into {cache} (WORKBENCH_DATA_DIR sets where that is).",
        ]
        if spec.package:
            lines.append(f"  - or install the Python package that provides {spec.package!r}.")
        return DataUnavailableError("\n".join(lines))


def _package_file(spec: FileSpec) -> Path | str:
    """The resource's path inside the installed package, or why there is none."""
    try:
        # find_spec locates a top-level package without importing it (sklearn is slow to import).
        found = importlib.util.find_spec(spec.package)  # type: ignore[arg-type]
    except (ImportError, ValueError) as e:
        return f"cannot locate package: {one_line(e)}"
    if found is None:
        return f"package {spec.package!r} is not installed"
    bases = list(found.submodule_search_locations or [])
    if not bases and found.origin:
        bases = [str(Path(found.origin).parent)]
    for base in bases:
        candidate = Path(base) / spec.resource  # type: ignore[operator]
        if candidate.is_file():
            return candidate
    return f"no {spec.resource} in package {spec.package!r} (looked in {', '.join(bases)})"


def _env_flag(var: str) -> bool:
    return os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")


_used: dict[str, dict[str, Any]] = {}
_used_lock = threading.Lock()


def resolve(
    name: str,
    *,
    extra_dirs: Sequence[PathLike] | None = None,
    cache: PathLike | None = None,
    mirrors: Sequence[PathLike] | None = None,
    offline: bool | None = None,
    progress: bool = True,
) -> ResolvedData:
    """Verified local files of dataset ``name``, fetched into the cache if needed.

    ``cache`` defaults to :func:`cache_dir`; ``mirrors`` to ``WORKBENCH_DATA_MIRROR``
    (pass ``[]`` for none): local folders, or object-store URLs (``s3://bucket/prefix``, read
    with the AWS_* environment's credentials); ``offline`` to ``WORKBENCH_OFFLINE``. Offline
    means none of the manifests' URLs: a mirror is one you configured, and is used either way.
    ``progress=False`` silences the progress bar (stderr). Raises DataUnavailableError when no
    source has the file, IntegrityError when the only copies found are corrupt, and
    UnsafeArchiveError for archives with members escaping the dataset directory.
    Archives are extracted once per archive sha256; files extracted from them are
    not re-verified.
    """
    manifest = load_manifest(name, extra_dirs)
    cache_root = Path(cache).expanduser() if cache is not None else cache_dir()
    mirror_dirs = (
        as_mirrors(mirrors) if mirrors is not None else env_mirrors("WORKBENCH_DATA_MIRROR")
    )
    offline = _env_flag("WORKBENCH_OFFLINE") if offline is None else offline
    cache_root.mkdir(parents=True, exist_ok=True)
    with dataset_lock(cache_root, manifest.name):
        resolved = _Resolver(manifest, cache_root, mirror_dirs, offline, progress).run()
    with _used_lock:
        # Re-insert, so the latest version resolved is the one recorded.
        _used.pop(manifest.name, None)
        _used[manifest.name] = resolved.record()
    return resolved


def fetch(name: str, **kwargs: Any) -> ResolvedData:
    """Fill the cache with dataset ``name``; same arguments as :func:`resolve`."""
    return resolve(name, **kwargs)


def used_datasets() -> list[dict[str, Any]]:
    """Records of the datasets resolved in this process, one per name (latest wins)."""
    with _used_lock:
        return [json.loads(json.dumps(r)) for r in _used.values()]


def reset_used_datasets() -> None:
    """Forget what was resolved, e.g. between runs in one notebook kernel."""
    with _used_lock:
        _used.clear()
