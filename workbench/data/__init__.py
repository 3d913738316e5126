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
  ``<name>/<version>/<path>``), then the manifest's URLs unless offline (``offline=True`` or
  ``WORKBENCH_OFFLINE=1``);
* ``source: package``: the file inside the installed package, then mirrors;
* ``source: synthetic``: a registered generator (see :data:`GENERATORS`).

A file whose size or sha256 differs from the manifest is never used. Each
resolved dataset is remembered for :func:`used_datasets`, so a run directory can
say exactly what data it saw.

The modules, each by concern, each with a public interface in its ``__all__`` (no
module imports another's underscore names; tests/test_data.py checks it):

* ``errors``: the exceptions, and :func:`~errors.one_line` for causes in messages;
* ``search_paths``: directory lists from an argument or an environment variable;
* ``generators``: synthetic data generators and their registry;
* ``manifest``: what a manifest is, parsing and validating one file;
* ``manifest_lookup``: where manifests are found, listing and loading them by name;
* ``cache``: the cache on disk, its layout, state, locks, temp files and hashing;
* ``archives``: safe extraction of tar and zip archives;
* ``resolution``: :func:`resolve`, from cache, package, mirrors, URLs or a generator;
* ``verification``: :func:`verify`, re-hashing the cache against the manifests.

Everything below is what the rest of workbench and its users import, from
``workbench.data`` itself.
"""

from __future__ import annotations

from workbench.data.cache import cache_dir
from workbench.data.errors import (
    DataUnavailableError,
    IntegrityError,
    ManifestError,
    UnsafeArchiveError,
)
from workbench.data.generators import GENERATORS, Generator, register_generator
from workbench.data.manifest import SCHEMA_VERSION, SOURCES, FileSpec, Manifest
from workbench.data.manifest_lookup import (
    MANIFEST_DIR,
    list_manifests,
    load_manifest,
    manifest_dirs,
)
from workbench.data.resolution import (
    ResolvedData,
    fetch,
    reset_used_datasets,
    resolve,
    used_datasets,
)
from workbench.data.search_paths import PathLike
from workbench.data.verification import FileCheck, verify

__all__ = [
    "GENERATORS",
    "MANIFEST_DIR",
    "SCHEMA_VERSION",
    "SOURCES",
    "DataUnavailableError",
    "FileCheck",
    "FileSpec",
    "Generator",
    "IntegrityError",
    "Manifest",
    "ManifestError",
    "PathLike",
    "ResolvedData",
    "UnsafeArchiveError",
    "cache_dir",
    "fetch",
    "list_manifests",
    "load_manifest",
    "manifest_dirs",
    "register_generator",
    "reset_used_datasets",
    "resolve",
    "used_datasets",
    "verify",
]
