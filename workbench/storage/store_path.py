"""StorePath: a place on an object store (s3://bucket/prefix/...) that the checkpoint code handles
as it handles a local pathlib.Path: `/`, name, exists, read_bytes, write_bytes, glob,
stat().st_size.
str() of one is its URL, which DCP's fsspec writer and reader take as a checkpoint_id.

Where checkpoints go (`checkpoints_root`): the run directory's checkpoints/ by default; with
RunConfig.checkpoint_url, `<url>/<run_name>/`. The run's name is in the path because a prefix is
shared: two runs given the same checkpoint_url must not seal, sweep or resume each other's steps.
A plain path or file:// URL is a local folder, handled as the run directory's own checkpoints/
(tmp+rename), under `<folder>/<run_name>/`.

Every query reads the store afresh: fsspec caches listings per filesystem, and other ranks (or
another session) write the same prefix meanwhile.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from workbench.storage.remote import configure, filesystem, is_remote

if TYPE_CHECKING:
    from workbench.config import RunConfig

log = logging.getLogger("workbench")


class StorePath:
    """A file or prefix on an object store, by URL; its children share one filesystem object."""

    def __init__(self, url: str, fs: Any = None) -> None:
        self.url = url.rstrip("/")
        self._fs = fs
        # DCP builds its own filesystem for this URL (a checkpoint_id): it gets the same options
        configure(self.url)

    # ---- naming ----------------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"StorePath({self.url!r})"

    def __truediv__(self, name: str | os.PathLike[str]) -> StorePath:
        return StorePath(f"{self.url}/{str(name).strip('/')}", self._fs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and other.url == self.url

    def __lt__(self, other: StorePath) -> bool:
        return self.url < other.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StorePath:
        return StorePath(self.url.rsplit("/", 1)[0], self._fs)

    def relative_to(self, other: StorePath) -> str:
        prefix = other.url + "/"
        if not self.url.startswith(prefix):
            raise ValueError(f"{self.url} is not under {other.url}")
        return self.url[len(prefix) :]

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs, _ = filesystem(self.url)
        return self._fs

    @property
    def path(self) -> str:
        """The path within the filesystem (bucket/prefix/...)."""
        return self.fs._strip_protocol(self.url)

    def _fresh(self) -> Any:
        fs = self.fs
        fs.invalidate_cache()
        return fs

    def _child(self, path: str) -> StorePath:
        scheme = urlsplit(self.url).scheme
        return StorePath(f"{scheme}://{path.strip('/')}", self._fs)

    # ---- reading ---------------------------------------------------------------------------------
    def exists(self) -> bool:
        return bool(self._fresh().exists(self.path))

    def is_file(self) -> bool:
        return bool(self._fresh().isfile(self.path))

    def is_dir(self) -> bool:
        return bool(self._fresh().isdir(self.path))

    def read_bytes(self) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        return bytes(self._fresh().cat_file(self.path))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def stat(self) -> types.SimpleNamespace:
        """st_size only: what a checkpoint's manifest records."""
        return types.SimpleNamespace(st_size=int(self._fresh().size(self.path)))

    def open(self, mode: str = "rb") -> Any:
        return self._fresh().open(self.path, mode)

    def glob(self, pattern: str) -> Iterator[StorePath]:
        """The objects and prefixes directly under this one that match `pattern` (one level)."""
        fs = self._fresh()
        found = fs.glob(f"{self.path}/{pattern}")
        return iter(sorted(self._child(p) for p in found))

    def files(self) -> list[str]:
        """Every object under this prefix, as paths relative to it, sorted."""
        fs = self._fresh()
        base = self.path.rstrip("/") + "/"
        return sorted(p[len(base) :] for p in fs.find(self.path) if p.startswith(base))

    # ---- writing ---------------------------------------------------------------------------------
    def write_bytes(self, data: bytes) -> None:
        """One object, whole: a PUT is atomic on an object store (readers see all of it or none)."""
        self.fs.pipe_file(self.path, data)

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to make: a prefix exists once an object is written under it."""

    def remove(self) -> None:
        """Remove this object or every object under this prefix (none there: nothing to do)."""
        fs = self._fresh()
        try:
            fs.rm(self.path, recursive=True)
        except FileNotFoundError:
            pass


Location = Path | StorePath
"""Where a checkpoint is: a local folder, or a prefix on an object store."""


def checkpoints_root(run_path: Path, url: str | None) -> Location:
    """The folder or prefix a run's checkpoints go to (see the module docstring for why the run's
    name is in it)."""
    if url is None:
        return run_path / "checkpoints"
    if is_remote(url):
        return StorePath(url) / run_path.name
    local = url.removeprefix("file://") if url.startswith("file://") else url
    return Path(local).expanduser() / run_path.name


def remove_tree(where: Location) -> None:
    """A checkpoint's folder or prefix removed, whatever is there (nothing: nothing to do)."""
    import shutil

    if isinstance(where, StorePath):
        where.remove()
    else:
        shutil.rmtree(where, ignore_errors=True)


def stored_config(path: StorePath) -> RunConfig | None:
    """The RunConfig in a checkpoint's config.yaml on a store; None when it has none."""
    from workbench.config import RunConfig
    from workbench.config.config_files import coerce, from_dict
    from workbench.utils.files import load_yaml

    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    data = load_yaml(text, str(path)) or {}
    if isinstance(data, dict):
        data = {key: coerce(RunConfig, key, value) for key, value in data.items()}
    return from_dict(RunConfig, data, source=str(path))
