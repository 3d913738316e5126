"""Data manifests: declared, verified, offline-first datasets.

Every dataset a run uses is declared by one YAML manifest, found in
``data-manifests/`` at the repository root or in a user directory
(``WORKBENCH_MANIFESTS`` or ``extra_dirs``; a user manifest wins over a
built-in one of the same name). :func:`resolve` turns a manifest into verified
files in the cache, ``<cache>/<name>/<version>/<path>``, looking in turn at:

* the cache itself (``WORKBENCH_DATA_DIR``, default
  ``platformdirs.user_cache_dir("workbench")/data``);
* ``source: url`` (the default): mirror directories (``WORKBENCH_DATA_MIRROR``,
  ``os.pathsep``-separated, holding ``<name>/<path>`` or a copied cache's
  ``<name>/<version>/<path>``), then the manifest's URLs unless offline
  (``offline=True`` or ``WORKBENCH_OFFLINE=1``);
* ``source: package``: the file inside the installed package, then mirrors;
* ``source: synthetic``: a registered generator (see :data:`GENERATORS`).

A file whose size or sha256 differs from the manifest is never used. Each
resolved dataset is remembered for :func:`used_datasets`, so a run directory can
say exactly what data it saw.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import posixpath
import random
import re
import shutil
import stat
import struct
import sys
import tarfile
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Callable, Iterator, Literal, Mapping, Sequence, Union

import filelock
import platformdirs
import yaml
from tqdm import tqdm

log = logging.getLogger("workbench")

SCHEMA_VERSION = 1
SOURCES = ("url", "package", "synthetic")
#: Built-in manifests live beside the package, at the repository root.
def _builtin_manifest_dir() -> Path:
    """data-manifests/ of a source checkout (editable install), else the copy a wheel ships."""
    checkout = Path(__file__).resolve().parent.parent / "data-manifests"
    if checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parent / "builtin_manifests"


MANIFEST_DIR = _builtin_manifest_dir()

PathLike = Union[str, "os.PathLike[str]"]

_DOWNLOAD_TIMEOUT_S = 30
_CHUNK = 1 << 20
# Every temporary file or directory we create starts with this, so leftovers of
# a killed process can be recognised and removed under the dataset lock.
_TMP_PREFIX = ".wb-tmp-"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_SHA256_RE = re.compile(r"^[0-9a-fA-F]{64}$")
_PACKAGE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_URL_SCHEMES = ("http", "https", "ftp", "file")

_TOP_REQUIRED = ("schema_version", "name", "description", "license", "homepage", "version", "files")
_TOP_OPTIONAL = ("source",)
# (required, optional) keys of one `files` entry, per source type.
_FILE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "url": (("path", "urls", "sha256", "size"), ("extract",)),
    "package": (("path", "package", "resource", "sha256", "size"), ("extract",)),
    "synthetic": (("path", "generator"), ("params", "seed", "sha256", "size")),
}
_OFFLINE_REASON = "skipped: offline (offline=True or WORKBENCH_OFFLINE=1)"


class ManifestError(ValueError):
    """A manifest is malformed, or no manifest declares the requested dataset."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


class IntegrityError(ValueError):
    """A file's size or sha256 differs from its manifest; the file was not used."""

    def __init__(self, message: str, *, expected: str | None, actual: str | None, location: str) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual
        self.location = location


class DataUnavailableError(RuntimeError):
    """No cache entry, mirror, package, or URL could provide a dataset file."""


class UnsafeArchiveError(ValueError):
    """An archive member would land outside the dataset directory."""


# --------------------------------------------------------------------------
# Synthetic data generators
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Generator:
    """A deterministic data generator usable from ``source: synthetic`` manifests."""

    name: str
    write: Callable[[BinaryIO, dict[str, Any], int], None]
    defaults: Mapping[str, Any]
    description: str


#: Generators by name; add your own with :func:`register_generator`.
GENERATORS: dict[str, Generator] = {}


def register_generator(name: str, defaults: Mapping[str, Any]) -> Callable:
    """Decorator registering ``fn(out: BinaryIO, params: dict, seed: int)``.

    ``defaults`` lists every accepted parameter; manifests may override them,
    and an unknown parameter is a manifest error. The output must depend only
    on params and seed, byte for byte, on every platform.
    """

    def decorate(fn: Callable[[BinaryIO, dict[str, Any], int], None]) -> Callable:
        doc = (fn.__doc__ or "").strip().splitlines()
        GENERATORS[name] = Generator(name, fn, dict(defaults), doc[0] if doc else "")
        return fn

    return decorate


def _normal(rng: random.Random) -> float:
    # Irwin-Hall approximation: only IEEE additions of random.random(), whose
    # stream Python guarantees, so bytes match on every platform. gauss() uses
    # libm, and sum() changed its float algorithm in Python 3.12.
    acc = 0.0
    for _ in range(12):
        acc += rng.random()
    return acc - 6.0


def _positive_int(params: Mapping[str, Any], key: str, upper: int | None = None) -> int:
    value = params[key]
    if type(value) is not int or value < 1 or (upper is not None and value > upper):
        bound = f" and at most {upper}" if upper is not None else ""
        raise ValueError(f"generator parameter {key!r} must be an integer of at least 1{bound}, got {value!r}")
    return value


def _write_csv_row(out: BinaryIO, values: Sequence[float], last: str = "") -> None:
    # Fixed-precision formatting is correctly rounded by CPython: stable bytes.
    text = ",".join(f"{v:.6f}" for v in values)
    out.write((text + ("," + last if last else "") + "\n").encode("ascii"))


@register_generator("gaussian-blobs",
                    {"n_samples": 300, "n_features": 2, "centers": 3, "cluster_std": 1.0, "center_box": 10.0})
def _gaussian_blobs(out: BinaryIO, params: dict[str, Any], seed: int) -> None:
    """CSV of Gaussian clusters for classification: x0..x{d-1},label."""
    n, d, k = (_positive_int(params, key) for key in ("n_samples", "n_features", "centers"))
    rng = random.Random(seed)
    centers = [[(2.0 * rng.random() - 1.0) * params["center_box"] for _ in range(d)] for _ in range(k)]
    out.write((",".join(f"x{j}" for j in range(d)) + ",label\n").encode("ascii"))
    for i in range(n):
        label = i % k
        _write_csv_row(out, [c + params["cluster_std"] * _normal(rng) for c in centers[label]], str(label))


@register_generator("linear-regression", {"n_samples": 200, "n_features": 4, "noise": 0.1})
def _linear_regression(out: BinaryIO, params: dict[str, Any], seed: int) -> None:
    """CSV for regression, y = x.w + noise with fixed random w: x0..x{d-1},y."""
    n, d = _positive_int(params, "n_samples"), _positive_int(params, "n_features")
    rng = random.Random(seed)
    weights = [2.0 * rng.random() - 1.0 for _ in range(d)]
    out.write((",".join(f"x{j}" for j in range(d)) + ",y\n").encode("ascii"))
    for _ in range(n):
        x = [_normal(rng) for _ in range(d)]
        y = 0.0
        for w, xj in zip(weights, x):
            y += w * xj
        _write_csv_row(out, [*x, y + params["noise"] * _normal(rng)])


@register_generator("random-tokens", {"vocab_size": 256, "length": 100_000})
def _random_tokens(out: BinaryIO, params: dict[str, Any], seed: int) -> None:
    """Uniform random token ids as little-endian uint16 (numpy: np.fromfile(p, "<u2"))."""
    vocab = _positive_int(params, "vocab_size", upper=65536)
    length = _positive_int(params, "length")
    rng = random.Random(seed)
    for start in range(0, length, 65536):
        count = min(65536, length - start)
        tokens = [min(vocab - 1, int(rng.random() * vocab)) for _ in range(count)]
        out.write(struct.pack(f"<{count}H", *tokens))


# --------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class FileSpec:
    """One file of a dataset, as declared in its manifest."""

    path: str
    sha256: str | None = None  # lowercase hex; None only for synthetic files
    size: int | None = None
    urls: tuple[str, ...] = ()
    extract: bool = False
    package: str | None = None
    resource: str | None = None
    generator: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    def generator_spec(self) -> dict[str, Any]:
        """What a synthetic file is generated from, defaults filled in."""
        defaults = GENERATORS[self.generator].defaults if self.generator in GENERATORS else {}
        params = {**defaults, **self.params}
        return {"generator": self.generator, "params": params, "seed": self.seed}


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated data manifest."""

    name: str
    version: str
    description: str
    license: str
    homepage: str
    source: str
    files: tuple[FileSpec, ...]
    path: Path

    def describe(self) -> str:
        """Multi-line human-readable description, for ``workbench data show``."""
        lines = [
            f"{self.name} (version {self.version})",
            f"  {self.description}",
            f"  license:  {self.license}",
            f"  homepage: {self.homepage or '-'}",
            f"  source:   {self.source}",
            f"  manifest: {self.path}",
            "  files:",
        ]
        for spec in self.files:
            facts = [f"{spec.size:,} bytes" if spec.size is not None else None,
                     f"sha256 {spec.sha256}" if spec.sha256 else None,
                     "archive, extracted into the dataset directory" if spec.extract else None]
            lines.append("    " + "  ".join([spec.path, *(f for f in facts if f)]))
            lines += [f"      {url}" for url in spec.urls]
            if spec.package:
                lines.append(f"      from installed package {spec.package}: {spec.resource}")
            if spec.generator:
                params = ", ".join(f"{k}={v!r}" for k, v in spec.generator_spec()["params"].items())
                lines.append(f"      generated by {spec.generator}(seed={spec.seed}, {params})")
        return "\n".join(lines)


def _plural(word: str, items: Sequence[Any]) -> str:
    return word if len(items) == 1 else word + "s"


def _check_keys(raw: Mapping[Any, Any], required: Sequence[str], optional: Sequence[str], where: str,
                problems: list[str]) -> None:
    unknown = sorted(str(k) for k in raw if k not in required and k not in optional)
    missing = [k for k in required if k not in raw]
    if unknown:
        allowed = ", ".join(sorted([*required, *optional]))
        names = ", ".join(map(repr, unknown))
        problems.append(f"unknown {_plural('key', unknown)} {names}{where} (allowed: {allowed})")
    if missing:
        problems.append(f"missing required {_plural('key', missing)} {', '.join(map(repr, missing))}{where}")


def _is_absolute(path: str) -> bool:
    """Absolute on any platform; archives and manifests may come from Windows."""
    path = path.replace("\\", "/")
    return path.startswith("/") or re.match(r"^[A-Za-z]:", path) is not None


def _relative_path(value: Any) -> str | None:
    """Normalised relative POSIX path, or None if it is absolute or climbs out."""
    if not isinstance(value, str) or not value or "\\" in value or _is_absolute(value):
        return None
    parts = PurePosixPath(value).parts
    if ".." in parts or not parts:
        return None
    return str(PurePosixPath(*parts))


def _same_kind(default: Any, value: Any) -> bool:
    """Whether a manifest value fits a generator parameter whose default is ``default``."""
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, int):
        return isinstance(value, int)
    return True


def _parse_file(raw: Any, index: int, source: str, problems: list[str]) -> FileSpec | None:
    if not isinstance(raw, dict):
        problems.append(f"files[{index}] must be a mapping (with path, sha256, size, ...), got {raw!r}")
        return None
    before = len(problems)
    where = f" in files[{index}]" + (f" ({raw['path']})" if isinstance(raw.get("path"), str) else "")
    _check_keys(raw, *_FILE_KEYS[source], where, problems)
    raw = {k: v for k, v in raw.items() if k in _FILE_KEYS[source][0] + _FILE_KEYS[source][1]}  # reported once is enough

    def bad(key: str, expectation: str) -> None:
        problems.append(f"{key}{where} must be {expectation}, got {raw[key]!r}")

    path = _relative_path(raw.get("path"))
    if "path" in raw and path is None:
        bad("path", "a relative path inside the dataset directory (no '..', not absolute)")
    sha256 = raw.get("sha256")
    if sha256 is not None and not (isinstance(sha256, str) and _SHA256_RE.match(sha256)):
        bad("sha256", "64 hexadecimal characters")
    size = raw.get("size")
    if size is not None and (type(size) is not int or size < 0):
        bad("size", "a non-negative integer number of bytes")
    urls = raw.get("urls", [])
    if "urls" in raw and not (isinstance(urls, list) and urls and all(
            isinstance(u, str) and urllib.parse.urlsplit(u).scheme in _URL_SCHEMES for u in urls)):
        bad("urls", f"a non-empty list of URLs ({', '.join(_URL_SCHEMES)})")
    if "extract" in raw and not isinstance(raw["extract"], bool):
        bad("extract", "true or false")
    if "package" in raw and not (isinstance(raw["package"], str) and _PACKAGE_RE.match(raw["package"])):
        bad("package", "an importable package name such as 'sklearn'")
    if "resource" in raw and _relative_path(raw["resource"]) is None:
        bad("resource", "a relative path inside the package (no '..', not absolute)")
    if "seed" in raw and type(raw["seed"]) is not int:
        bad("seed", "an integer")
    generator = GENERATORS.get(raw["generator"]) if isinstance(raw.get("generator"), str) else None
    if "generator" in raw and generator is None:
        bad("generator", f"one of: {', '.join(sorted(GENERATORS))}")
    params = raw.get("params", {})
    if not isinstance(params, dict):
        bad("params", "a mapping of generator parameters")
    elif generator is not None:
        for key, value in params.items():
            if key not in generator.defaults:
                takes = ", ".join(generator.defaults)
                problems.append(f"unknown generator parameter {key!r}{where} ({generator.name} takes: {takes})")
            elif not _same_kind(generator.defaults[key], value):
                kind = type(generator.defaults[key]).__name__
                problems.append(f"generator parameter {key!r}{where} must be a {kind}, got {value!r}")

    if len(problems) > before:
        return None
    return FileSpec(
        path=path,  # type: ignore[arg-type]
        sha256=sha256.lower() if sha256 else None,
        size=size,
        urls=tuple(urls),
        extract=raw.get("extract", False),
        package=raw.get("package"),
        resource=_relative_path(raw["resource"]) if "resource" in raw else None,
        generator=raw.get("generator"),
        # `noise: 1` means 1.0; normalising keeps the recorded generator spec canonical.
        params={k: float(v) if isinstance(generator.defaults[k], float) else v for k, v in params.items()}
        if generator is not None else {},
        seed=raw.get("seed", 0),
    )


def _parse_manifest(path: Path) -> Manifest:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ManifestError(f"cannot read data manifest {path}: {_one_line(e)}", path) from e
    if not isinstance(raw, dict):
        raise ManifestError(f"invalid data manifest {path}: expected a YAML mapping, got {type(raw).__name__}", path)

    problems: list[str] = []
    _check_keys(raw, _TOP_REQUIRED, _TOP_OPTIONAL, "", problems)

    def bad(key: str, expectation: str) -> None:
        problems.append(f"{key} must be {expectation}, got {raw[key]!r}")

    if "schema_version" in raw and (type(raw["schema_version"]) is not int or raw["schema_version"] != SCHEMA_VERSION):
        bad("schema_version", f"{SCHEMA_VERSION} (the manifest format this workbench reads)")
    name = raw.get("name")
    if "name" in raw:
        if not (isinstance(name, str) and _NAME_RE.match(name)):
            bad("name", "letters, digits, '.', '_' or '-'")
        elif name != path.stem:
            problems.append(f"name {name!r} must match the file name {path.name!r}")
    version = raw.get("version")
    if type(version) is int:  # `version: 1` in YAML is an int; same meaning
        version = str(version)
    if "version" in raw and not (isinstance(version, str) and _VERSION_RE.match(version)):
        bad("version", "a string such as '1' or '2024.1' (quote it in YAML)")
    for key in ("description", "license"):
        if key in raw and not (isinstance(raw[key], str) and raw[key].strip()):
            bad(key, "a non-empty string")
    if "homepage" in raw and not isinstance(raw["homepage"], str):
        bad("homepage", "a string (may be empty for synthetic data)")
    source = raw.get("source", "url")
    if source not in SOURCES:
        bad("source", f"one of {', '.join(SOURCES)}")
        source = "url"  # still check the files, to report every problem at once
    files = raw.get("files")
    specs: list[FileSpec | None] = []
    if "files" in raw:
        if not (isinstance(files, list) and files):
            bad("files", "a non-empty list")
        else:
            specs = [_parse_file(f, i, source, problems) for i, f in enumerate(files)]
    seen = [s.path for s in specs if s is not None]
    for dup in sorted({p for p in seen if seen.count(p) > 1}):
        problems.append(f"file path {dup!r} is declared more than once")

    if problems:
        raise ManifestError(f"invalid data manifest {path}:\n" + "\n".join(f"  - {p}" for p in problems), path)
    return Manifest(name=name, version=version, description=raw["description"].strip(), license=raw["license"].strip(),
                    homepage=raw["homepage"], source=source, files=tuple(specs), path=path)  # type: ignore[arg-type]


def _paths(value: PathLike | Sequence[PathLike] | None) -> list[Path]:
    # A lone path is accepted too: extra_dirs="manifests" must not mean ["m", "a", ...].
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    return [Path(p).expanduser() for p in value or ()]


def _env_paths(var: str) -> list[Path]:
    return [Path(p).expanduser() for p in os.environ.get(var, "").split(os.pathsep) if p.strip()]


def manifest_dirs(extra_dirs: Sequence[PathLike] | None = None) -> list[Path]:
    """Directories searched for manifests, highest priority first.

    ``extra_dirs``, then ``WORKBENCH_MANIFESTS`` (``os.pathsep``-separated), then
    the built-in ``data-manifests/``.
    """
    dirs = _paths(extra_dirs) + _env_paths("WORKBENCH_MANIFESTS") + [MANIFEST_DIR]
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
            _warn_once(("missing-dir", str(d)), "data manifest directory %s does not exist; ignoring it", d)
            continue
        for p in sorted(d.iterdir()):
            if p.suffix in (".yaml", ".yml") and p.is_file():
                found.setdefault(p.stem, []).append(p)
    for name, paths in found.items():
        if len(paths) > 1:
            _warn_once(("override", *map(str, paths)), "data manifest %r: using %s, which overrides %s",
                       name, paths[0], ", ".join(map(str, paths[1:])))
    return {name: paths[0] for name, paths in found.items()}


def list_manifests(extra_dirs: Sequence[PathLike] | None = None) -> list[Manifest]:
    """Every known manifest (user ones overriding built-ins), sorted by name."""
    return [_parse_manifest(p) for _, p in sorted(_manifest_paths(extra_dirs).items())]


def load_manifest(name: str, extra_dirs: Sequence[PathLike] | None = None) -> Manifest:
    """The manifest of dataset ``name``; ManifestError lists the known names if there is none."""
    paths = _manifest_paths(extra_dirs)
    if name not in paths:
        known = ", ".join(sorted(paths)) or "(none)"
        searched = ", ".join(map(str, manifest_dirs(extra_dirs)))
        raise ManifestError(f"unknown dataset {name!r}; known datasets: {known} (manifests are read from: {searched})")
    return _parse_manifest(paths[name])


# --------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------


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
        return {"name": self.name, "version": self.version, "source": self.manifest.source, "files": dict(self.sha256)}

    def __getitem__(self, path: str) -> Path:
        """A declared file, or a file extracted from one of its archives."""
        if path in self.files:
            return self.files[path]
        relative = _relative_path(path)
        if relative is not None and (self.root / relative).exists():
            return self.root / relative
        raise KeyError(f"{self.name} has no file {path!r}; declared files: {', '.join(self.files)}")


def cache_dir() -> Path:
    """The data cache: ``WORKBENCH_DATA_DIR``, else ``user_cache_dir("workbench")/data``."""
    env = os.environ.get("WORKBENCH_DATA_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("workbench")) / "data"


def _one_line(e: BaseException | str) -> str:
    text = e if isinstance(e, str) else (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    return " ".join(text.split())


def _download_reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return _one_line(e.reason if isinstance(e.reason, BaseException) else str(e.reason))
    return _one_line(e)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _short(digest: str | None) -> str:
    return f"{digest[:12]}…" if digest else "?"


@dataclass
class _Copied:
    """A stream copied into a temp file next to its destination."""

    tmp: Path | None  # None when the stream exceeded the expected size
    sha256: str
    size: int


def _copy_to_temp(src: BinaryIO, dest_dir: Path, *, limit: int | None, desc: str, progress: bool) -> _Copied:
    """Copy and hash in one pass, so what is verified is exactly what was written."""
    fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=dest_dir)
    tmp = Path(name)
    h, size, too_big = hashlib.sha256(), 0, False
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=limit, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                                              disable=not progress, file=sys.stderr) as bar:
            while chunk := src.read(_CHUNK):
                size += len(chunk)
                if limit is not None and size > limit:
                    too_big = True  # stop rather than fill the disk with whatever a wrong URL serves
                    break
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; cache files should read like normal files
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if too_big:
        tmp.unlink()
        return _Copied(None, "", size)
    return _Copied(tmp, h.hexdigest(), size)


@dataclass
class _Attempt:
    """One place a file was looked for, and why it was not used."""

    where: str
    reason: str
    actual_sha256: str | None = None
    corrupt: bool = False


def _corrupt(where: str, sha: str, size: int) -> _Attempt:
    return _Attempt(where, f"corrupt: got sha256 {sha} ({size:,} bytes)", sha, corrupt=True)


_STATE_VERSION = 1


class _Resolver:
    """Resolves one manifest's files into the cache; runs under the dataset lock."""

    def __init__(self, manifest: Manifest, cache: Path, mirrors: list[Path], offline: bool, progress: bool) -> None:
        self.m = manifest
        self.cache = cache
        self.root = cache / manifest.name / manifest.version
        self.mirrors = mirrors
        self.offline = offline
        self.progress = progress
        self.state_path = cache / manifest.name / f".{manifest.version}.state.json"
        self.state = _load_state(self.state_path)

    def run(self) -> ResolvedData:
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        shas: dict[str, str] = {}
        origins: dict[str, str] = {}
        for spec in self.m.files:
            target = self.root / spec.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shas[spec.path], origins[spec.path] = self._file(spec, target)
            if spec.extract and self.state["extracted"].get(spec.path) != shas[spec.path]:
                log.info("data %s: extracting %s", self.m.name, spec.path)
                _extract_archive(target, self.root, protected={s.path for s in self.m.files}, manifest=self.m)
                self.state["extracted"][spec.path] = shas[spec.path]
                _save_state(self.state_path, self.state)
        return ResolvedData(self.m.name, self.m.version, self.root, {s.path: self.root / s.path for s in self.m.files},
                            self.m, shas, origins)

    def _remove_stale_temps(self) -> None:
        # Only a killed process leaves these; we hold the lock, so none is in use.
        for d in {self.state_path.parent, self.root, *((self.root / s.path).parent for s in self.m.files)}:
            if not d.is_dir():
                continue
            for p in d.glob(_TMP_PREFIX + "*"):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()

    def _label(self, spec: FileSpec) -> str:
        return f"{self.m.name}/{spec.path}"

    def _expected_sha(self, spec: FileSpec) -> str | None:
        if spec.sha256 or not spec.generator:
            return spec.sha256
        record = self.state["generated"].get(spec.path)
        # A record made from other params (manifest edited in place) says nothing about this spec.
        return record["sha256"] if record and record["spec"] == _jsonable(spec.generator_spec()) else None

    def _file(self, spec: FileSpec, target: Path) -> tuple[str, str]:
        attempts: list[_Attempt] = []
        expected = self._expected_sha(spec)
        if target.is_file() and expected is not None:
            sha = _sha256_file(target)
            size = target.stat().st_size
            if sha == expected and spec.size in (None, size):
                log.debug("data %s: cache hit %s", self._label(spec), target)
                return sha, "cache"
            log.warning("data %s: cached file %s is corrupt (expected sha256 %s, got %s); fetching it again",
                        self._label(spec), target, expected, sha)
            attempts.append(_corrupt(f"cache {target}", sha, size))
        else:
            why = "not present" if not target.exists() else "not generated from this spec"
            attempts.append(_Attempt(f"cache {target}", why))

        if self.m.source == "synthetic":
            return self._generate(spec, target, attempts)
        if self.m.source == "package":
            found = _package_file(spec)
            if isinstance(found, Path):
                result = self._from_local(spec, target, found, f"package {spec.package} ({found})")
                if isinstance(result, str):
                    return result, f"package {spec.package} ({found})"
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

    def _copy(self, src: BinaryIO, spec: FileSpec, target: Path) -> _Copied:
        return _copy_to_temp(src, target.parent, limit=spec.size, desc=self._label(spec), progress=self.progress)

    def _accept(self, spec: FileSpec, target: Path, copied: _Copied, where: str) -> str | _Attempt:
        """Move a verified temp file into the cache, or reject it."""
        if copied.tmp is None:
            return _Attempt(where, f"corrupt: more than the expected {spec.size:,} bytes (stopped reading)", corrupt=True)
        if (spec.size is not None and copied.size != spec.size) or (spec.sha256 and copied.sha256 != spec.sha256):
            copied.tmp.unlink()
            log.warning("data %s: rejected %s (expected sha256 %s, got %s)",
                        self._label(spec), where, spec.sha256, copied.sha256)
            return _corrupt(where, copied.sha256, copied.size)
        os.replace(copied.tmp, target)
        return copied.sha256

    def _from_local(self, spec: FileSpec, target: Path, src: Path, where: str) -> str | _Attempt:
        try:
            size = src.stat().st_size
            if spec.size is not None and size != spec.size:
                # Hash in place rather than copy a file we already know is wrong.
                return _corrupt(where, _sha256_file(src), size)
            with open(src, "rb") as f:
                copied = self._copy(f, spec, target)
        except OSError as e:
            return _Attempt(where, _one_line(e))
        result = self._accept(spec, target, copied, where)
        if isinstance(result, str):
            log.info("data %s: copied from %s", self._label(spec), src)
        return result

    def _from_mirrors(self, spec: FileSpec, target: Path, attempts: list[_Attempt]) -> tuple[str, str] | None:
        """(sha256, mirror file) of the first good mirror copy; failures are appended to attempts."""
        if not self.mirrors:
            attempts.append(_Attempt("mirrors", "none configured (WORKBENCH_DATA_MIRROR is not set)"))
        for mirror in self.mirrors:
            # <name>/<path> is the documented layout; <name>/<version>/<path> lets a copied cache serve as a mirror.
            candidates = [mirror / self.m.name / spec.path, mirror / self.m.name / self.m.version / spec.path]
            hit = next((c for c in candidates if c.is_file()), None)
            if hit is None:
                missing = "" if mirror.is_dir() else " (the mirror directory does not exist)"
                attempts.append(_Attempt(f"mirror {mirror}", f"has no {self.m.name}/{spec.path}{missing}"))
                continue
            result = self._from_local(spec, target, hit, f"mirror {hit}")
            if isinstance(result, str):
                return result, str(hit)
            attempts.append(result)
        return None

    def _from_url(self, spec: FileSpec, target: Path, url: str) -> str | _Attempt:
        log.info("data %s: downloading %s", self._label(spec), url)
        request = urllib.request.Request(url, headers={"User-Agent": "workbench-data"})
        try:
            with urllib.request.urlopen(request, timeout=_DOWNLOAD_TIMEOUT_S) as response:
                copied = self._copy(response, spec, target)
        except (OSError, HTTPException, ValueError) as e:  # URLError and timeouts are OSErrors
            return _Attempt(url, _download_reason(e))
        return self._accept(spec, target, copied, url)

    def _generate(self, spec: FileSpec, target: Path, attempts: list[_Attempt]) -> tuple[str, str]:
        gen_spec = spec.generator_spec()
        where = f"generator {spec.generator}(seed={spec.seed})"
        log.info("data %s: generating with %s", self._label(spec), where)
        fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=target.parent)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                GENERATORS[spec.generator].write(out, gen_spec["params"], spec.seed)  # type: ignore[index]
            os.chmod(tmp, 0o644)
            sha, size = _sha256_file(tmp), tmp.stat().st_size
        except ValueError as e:
            tmp.unlink(missing_ok=True)
            raise ManifestError(f"{self.m.path}: cannot generate {spec.path}: {e}", self.m.path) from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        result = self._accept(spec, target, _Copied(tmp, sha, size), where)
        if isinstance(result, _Attempt):
            raise self._failure(spec, [*attempts, result])
        self.state["generated"][spec.path] = {"sha256": sha, "spec": _jsonable(gen_spec)}
        _save_state(self.state_path, self.state)
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
                expected=spec.sha256, actual=corrupt[0].actual_sha256, location=corrupt[0].where)
        return DataUnavailableError(
            f"dataset {self.m.name!r} is not available: no copy of {spec.path} could be found.\n"
            f"Tried:\n{tried}\n"
            f"To use it without internet access, either:\n"
            f"  - put the file in a mirror directory and set WORKBENCH_DATA_MIRROR to that directory\n"
            f"    (WORKBENCH_DATA_MIRROR=/path/to/mirror, holding /path/to/mirror/{self.m.name}/{spec.path}), or\n"
            f"  - run `workbench data fetch {self.m.name}` on a machine with internet access and copy its\n"
            f"    cache directory {self.m.name}/ into {self.cache} (WORKBENCH_DATA_DIR sets where that is)."
            + (f"\n  - or install the Python package that provides {spec.package!r}." if spec.package else ""))


def _package_file(spec: FileSpec) -> Path | str:
    """The resource's path inside the installed package, or why there is none."""
    try:
        # find_spec locates a top-level package without importing it (sklearn is slow to import).
        found = importlib.util.find_spec(spec.package)  # type: ignore[arg-type]
    except (ImportError, ValueError) as e:
        return f"cannot locate package: {_one_line(e)}"
    if found is None:
        return f"package {spec.package!r} is not installed"
    bases = list(found.submodule_search_locations or []) or ([str(Path(found.origin).parent)] if found.origin else [])
    for base in bases:
        candidate = Path(base) / spec.resource  # type: ignore[operator]
        if candidate.is_file():
            return candidate
    return f"no {spec.resource} in package {spec.package!r} (looked in {', '.join(bases)})"


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _load_state(path: Path) -> dict[str, Any]:
    """What was generated and extracted in a dataset's cache directory."""
    try:
        state = json.loads(path.read_text())
        if state.get("state_version") == _STATE_VERSION:
            return state
    except (OSError, ValueError):
        pass
    return {"state_version": _STATE_VERSION, "generated": {}, "extracted": {}}


def _save_state(path: Path, state: dict[str, Any]) -> None:
    fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(name, path)


@contextmanager
def _dataset_lock(cache: Path, name: str) -> Iterator[None]:
    lock = filelock.FileLock(str(cache / f"{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        log.info("data %s: waiting for another process resolving it (lock %s)", name, lock.lock_file)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


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
    (pass ``[]`` for none); ``offline`` to ``WORKBENCH_OFFLINE``. ``progress=False``
    silences the progress bar (stderr). Raises DataUnavailableError when no source
    has the file, IntegrityError when the only copies found are corrupt, and
    UnsafeArchiveError for archives with members escaping the dataset directory.
    Archives are extracted once per archive sha256; files extracted from them are
    not re-verified.
    """
    manifest = load_manifest(name, extra_dirs)
    cache_root = Path(cache).expanduser() if cache is not None else cache_dir()
    mirror_dirs = _paths(mirrors) if mirrors is not None else _env_paths("WORKBENCH_DATA_MIRROR")
    offline = _env_flag("WORKBENCH_OFFLINE") if offline is None else offline
    cache_root.mkdir(parents=True, exist_ok=True)
    with _dataset_lock(cache_root, manifest.name):
        resolved = _Resolver(manifest, cache_root, mirror_dirs, offline, progress).run()
    with _used_lock:
        _used.pop(manifest.name, None)  # re-insert so the latest version resolved is the one recorded
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


# --------------------------------------------------------------------------
# Verification of the cache
# --------------------------------------------------------------------------


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


def verify(name: str | None = None, *, extra_dirs: Sequence[PathLike] | None = None,
           cache: PathLike | None = None) -> list[FileCheck]:
    """Re-hash cached files of dataset ``name`` (None: every manifest) against their manifests.

    Nothing is fetched or changed. A synthetic file without a sha256 in its
    manifest counts as missing until resolve() has generated it from the current spec.
    """
    manifests = [load_manifest(name, extra_dirs)] if name is not None else list_manifests(extra_dirs)
    cache_root = Path(cache).expanduser() if cache is not None else cache_dir()
    checks = []
    for m in manifests:
        resolver = _Resolver(m, cache_root, [], True, False)
        for spec in m.files:
            location = resolver.root / spec.path
            expected = resolver._expected_sha(spec)
            if not location.is_file() or expected is None:
                checks.append(FileCheck(m.name, spec.path, "missing", expected, None, location))
                continue
            actual = _sha256_file(location)
            status = "ok" if actual == expected else "corrupt"
            checks.append(FileCheck(m.name, spec.path, status, expected, actual, location))
    return checks


# --------------------------------------------------------------------------
# Archives
# --------------------------------------------------------------------------


def _refuse(archive: Path, member: str, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(f"refusing to extract {archive}: member {member!r} {why}")


def _member_path(archive: Path, member: str, is_dir: bool, protected: set[str]) -> PurePosixPath:
    """The member's relative path, refusing any that could escape or clobber declared files."""
    if _is_absolute(member):
        raise _refuse(archive, member, "has an absolute path")
    path = PurePosixPath(member.replace("\\", "/"))
    if ".." in path.parts:
        raise _refuse(archive, member, "has a '..' component, which would land outside the dataset directory")
    clobbered = [p for p in protected if p == str(path) or (not is_dir and PurePosixPath(p).is_relative_to(path))]
    if clobbered:
        raise _refuse(archive, member, f"would overwrite {clobbered[0]!r}, which the manifest declares")
    return path


def _check_link(archive: Path, member: str, link: str, base: PurePosixPath) -> None:
    if _is_absolute(link):
        raise _refuse(archive, member, f"is a link to the absolute path {link!r}")
    target = posixpath.normpath(posixpath.join(str(base), link.replace("\\", "/")))
    if target == ".." or target.startswith("../"):
        raise _refuse(archive, member, f"is a link to {link!r}, outside the dataset directory")


def _check_not_through_links(archive: Path, members: dict[PurePosixPath, str], links: set[PurePosixPath]) -> None:
    # A member under a symlinked directory is written wherever the link points.
    for path, member in members.items():
        through = next((p for p in path.parents if p in links), None)
        if through is not None:
            raise _refuse(archive, member, f"lies inside the symlink {str(through)!r}")


def _untar(archive: Path, dest: Path, protected: set[str]) -> None:
    with tarfile.open(archive) as tar:
        infos = tar.getmembers()
        members, links = {}, set()
        for info in infos:
            path = _member_path(archive, info.name, info.isdir(), protected)
            members[path] = info.name
            if info.issym():
                _check_link(archive, info.name, info.linkname, path.parent)
                links.add(path)
            elif info.islnk():  # hard link names are relative to the archive root
                _check_link(archive, info.name, info.linkname, PurePosixPath("."))
            elif not (info.isfile() or info.isdir()):
                raise _refuse(archive, info.name, "is a device or fifo")
        _check_not_through_links(archive, members, links)
        # Defence in depth: the stdlib's data filter also checks links as they are resolved on disk.
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        try:
            tar.extractall(dest, members=infos, **kwargs)
        except getattr(tarfile, "FilterError", ()) as e:
            raise _refuse(archive, e.tarinfo.name, f"was refused by tarfile's data filter: {e}") from e


def _unzip(archive: Path, dest: Path, protected: set[str]) -> None:
    with zipfile.ZipFile(archive) as zf:
        members, links = {}, {}
        for info in zf.infolist():
            path = _member_path(archive, info.filename, info.is_dir(), protected)
            members[path] = info.filename
            if stat.S_ISLNK(info.external_attr >> 16):
                target = zf.read(info).decode("utf-8", "replace")
                _check_link(archive, info.filename, target, path.parent)
                links[path] = target
        _check_not_through_links(archive, members, set(links))
        zf.extractall(dest)
    # zipfile writes symlinks as plain files holding the target; make them real links.
    for path, target in links.items():
        (dest / path).unlink()
        os.symlink(target, dest / path)


def _merge_into(src: Path, dst: Path) -> None:
    # Directories merge, so two archives sharing a top-level folder don't erase each other.
    for entry in src.iterdir():
        target = dst / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir() and not target.is_symlink():
            _merge_into(entry, target)
            continue
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(entry, target)


def _extract_archive(archive: Path, dest: Path, *, protected: set[str], manifest: Manifest) -> None:
    """Unpack a tar or zip into ``dest``, via a temp dir so a refused archive leaves nothing behind."""
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=dest))
    try:
        if zipfile.is_zipfile(archive):
            _unzip(archive, tmp, protected)
        elif tarfile.is_tarfile(archive):
            _untar(archive, tmp, protected)
        else:
            raise ManifestError(f"{manifest.path}: {archive.name} has extract: true but is neither a tar nor a zip "
                                "archive", manifest.path)
        _merge_into(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
