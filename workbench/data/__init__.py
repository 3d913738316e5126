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

The code lives in small modules: ``manifest`` (manifests: parsing, validation,
where they are found), ``generators`` (synthetic data), ``cache`` (the cache on
disk), ``resolution`` (:func:`resolve`), ``verification`` (:func:`verify`),
``archives`` (safe extraction) and ``errors``; everything public is importable
from ``workbench.data`` itself.
"""

from __future__ import annotations

from workbench.data.cache import cache_dir
from workbench.data.errors import DataUnavailableError, IntegrityError, ManifestError, UnsafeArchiveError
from workbench.data.generators import GENERATORS, Generator, register_generator
from workbench.data.manifest import (
                       MANIFEST_DIR,
                       SCHEMA_VERSION,
                       SOURCES,
                       FileSpec,
                       Manifest,
                       PathLike,
                       list_manifests,
                       load_manifest,
                       manifest_dirs,
)
from workbench.data.resolution import ResolvedData, fetch, reset_used_datasets, resolve, used_datasets
from workbench.data.verification import FileCheck, verify

__all__ = [
    "SCHEMA_VERSION", "SOURCES", "MANIFEST_DIR", "PathLike",
    "ManifestError", "IntegrityError", "DataUnavailableError", "UnsafeArchiveError",
    "Generator", "GENERATORS", "register_generator",
    "FileSpec", "Manifest", "manifest_dirs", "list_manifests", "load_manifest",
    "ResolvedData", "cache_dir", "resolve", "fetch", "used_datasets", "reset_used_datasets",
    "FileCheck", "verify",
]
