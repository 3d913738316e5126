"""Safe extraction of tar and zip archives into a dataset directory."""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from workbench.data.cache import TMP_PREFIX
from workbench.data.errors import ManifestError, UnsafeArchiveError
from workbench.data.manifest import Manifest, is_absolute

__all__ = ["extract_archive"]


def _refuse(archive: Path, member: str, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(f"refusing to extract {archive}: member {member!r} {why}")


def _member_path(archive: Path, member: str, is_dir: bool, protected: set[str]) -> PurePosixPath:
    """The member's relative path, refusing any that could escape or clobber declared files."""
    if is_absolute(member):
        raise _refuse(archive, member, "has an absolute path")
    path = PurePosixPath(member.replace("\\", "/"))
    if ".." in path.parts:
        raise _refuse(archive, member,
                      "has a '..' component, which would land outside the dataset directory")
    clobbered = [p for p in protected
                 if p == str(path) or (not is_dir and PurePosixPath(p).is_relative_to(path))]
    if clobbered:
        raise _refuse(archive, member,
                      f"would overwrite {clobbered[0]!r}, which the manifest declares")
    return path


def _check_link(archive: Path, member: str, link: str, base: PurePosixPath) -> None:
    if is_absolute(link):
        raise _refuse(archive, member, f"is a link to the absolute path {link!r}")
    target = posixpath.normpath(posixpath.join(str(base), link.replace("\\", "/")))
    if target == ".." or target.startswith("../"):
        raise _refuse(archive, member, f"is a link to {link!r}, outside the dataset directory")


def _check_not_through_links(archive: Path, members: dict[PurePosixPath, str],
                             links: set[PurePosixPath]) -> None:
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
        # Defence in depth: the stdlib's data filter also checks links as resolved on disk.
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        try:
            tar.extractall(dest, members=infos, **kwargs)
        except getattr(tarfile, "FilterError", ()) as e:
            raise _refuse(archive, e.tarinfo.name,
                          f"was refused by tarfile's data filter: {e}") from e


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
        if (entry.is_dir() and not entry.is_symlink()
                and target.is_dir() and not target.is_symlink()):
            _merge_into(entry, target)
            continue
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(entry, target)


def extract_archive(archive: Path, dest: Path, *, protected: set[str], manifest: Manifest) -> None:
    """Unpack a tar or zip into ``dest``, refusing members that escape it or clobber ``protected``.

    Unpacks into a temp dir first, so a refused archive leaves nothing behind. Raises
    UnsafeArchiveError for a refused member, ManifestError if it is no archive at all.
    """
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=dest))
    try:
        if zipfile.is_zipfile(archive):
            _unzip(archive, tmp, protected)
        elif tarfile.is_tarfile(archive):
            _untar(archive, tmp, protected)
        else:
            raise ManifestError(f"{manifest.path}: {archive.name} has extract: true but is neither "
                                "a tar nor a zip archive", manifest.path)
        _merge_into(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
