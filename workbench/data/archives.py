"""Safe extraction of tar and zip archives into a dataset directory."""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from workbench.data.cache import TMP_PREFIX
from workbench.data.errors import ManifestError, UnsafeArchiveError
from workbench.data.manifest import Manifest, is_absolute

__all__ = ["extract_archive"]

_MAX_LINK_HOPS = 40
"""Links followed in one path before it counts as a loop (Linux's MAXSYMLINKS)."""


def _refuse(archive: Path, member: str, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(f"refusing to extract {archive}: member {member!r} {why}")


def _member_path(archive: Path, member: str, is_dir: bool, protected: set[str]) -> PurePosixPath:
    """The member's relative path, refusing any that could escape or clobber declared files."""
    if is_absolute(member):
        raise _refuse(archive, member, "has an absolute path")
    path = PurePosixPath(member.replace("\\", "/"))
    if ".." in path.parts:
        raise _refuse(
            archive, member, "has a '..' component, which would land outside the dataset directory"
        )
    clobbered = [
        p
        for p in protected
        if p == str(path) or (not is_dir and PurePosixPath(p).is_relative_to(path))
    ]
    if clobbered:
        raise _refuse(
            archive, member, f"would overwrite {clobbered[0]!r}, which the manifest declares"
        )
    return path


def _check_link(archive: Path, member: str, link: str, base: PurePosixPath) -> None:
    if is_absolute(link):
        raise _refuse(archive, member, f"is a link to the absolute path {link!r}")
    target = posixpath.normpath(posixpath.join(str(base), link.replace("\\", "/")))
    if target == ".." or target.startswith("../"):
        raise _refuse(archive, member, f"is a link to {link!r}, outside the dataset directory")


@dataclass
class _Listing:
    """Where an archive's members would land, by path relative to the dataset directory."""

    members: dict[PurePosixPath, str] = field(default_factory=dict)  # path -> member name
    dirs: set[PurePosixPath] = field(default_factory=set)
    links: dict[PurePosixPath, str] = field(default_factory=dict)  # symlink -> its target
    # hard link -> target, from the root
    hardlinks: dict[PurePosixPath, str] = field(default_factory=dict)

    def add(self, path: PurePosixPath, member: str, is_dir: bool) -> None:
        # The last member of a path wins, as when extracting.
        self.members[path] = member
        self.links.pop(path, None)
        self.hardlinks.pop(path, None)
        (self.dirs.add if is_dir else self.dirs.discard)(path)


def _escape(links: dict[PurePosixPath, str], start: PurePosixPath, target: str) -> str | None:
    """Follow `target` from the directory `start` the way the OS will once everything is in place,
    through every symlink in `links`: None when it stays inside the dataset directory, else why not.
    Normalising the text alone is not enough: with 'l2 -> .', 'l2/l2/../..' is '.' as text but '..'
    on disk."""
    if is_absolute(target):
        return "which is an absolute path"
    todo = [*reversed(target.replace("\\", "/").split("/")), *reversed(start.parts)]
    here: list[str] = []
    followed: list[str] = []
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not here:
                through = (
                    f" through the link(s) {', '.join(map(repr, dict.fromkeys(followed)))}"
                    if followed
                    else ""
                )
                return f"which leads outside the dataset directory{through}"
            here.pop()
            continue
        path = PurePosixPath(*here, part)
        if path not in links:
            here.append(part)
            continue
        followed.append(str(path))
        if len(followed) > _MAX_LINK_HOPS:
            return (
                "which goes round a loop of links "
                f"({', '.join(map(repr, dict.fromkeys(followed)))})"
            )
        if is_absolute(links[path]):
            return (
                f"which leads to the absolute path {links[path]!r} through the link {str(path)!r}"
            )
        todo.extend(reversed(links[path].replace("\\", "/").split("/")))
    return None


def _links_after_merge(dest: Path, listing: _Listing) -> dict[PurePosixPath, str]:
    """The symlinks of the dataset directory once the archive is merged in (see _merge_into): its
    own, and those already there (from other archives) that its members neither replace nor
    remove."""
    covered = {parent for path in listing.members for parent in (path, *path.parents)}
    # a file or link there removes a directory's whole tree
    replaced = set(listing.members) - listing.dirs
    links: dict[PurePosixPath, str] = {}
    for top, dirnames, filenames in os.walk(dest):
        # symlinks to directories are listed, not entered
        if Path(top) == dest:
            dirnames[:] = [d for d in dirnames if not d.startswith(TMP_PREFIX)]
        for name in (*dirnames, *filenames):
            entry = Path(top, name)
            path = PurePosixPath(entry.relative_to(dest).as_posix())
            if (
                entry.is_symlink()
                and path not in covered
                and not replaced.intersection(path.parents)
            ):
                links[path] = os.readlink(entry)
    return {**links, **listing.links}


def _check_listing(archive: Path, dest: Path, listing: _Listing) -> None:
    """Every link, followed through every other link, stays inside the dataset directory: chains
    within the archive, and chains through links that earlier archives left in `dest`."""
    _check_not_through_links(archive, listing.members, set(listing.links))
    links = _links_after_merge(dest, listing)
    for path, target in links.items():
        why = _escape(links, path.parent, target)
        if why and path in listing.links:
            raise _refuse(archive, listing.members[path], f"is a link to {target!r}, {why}")
        if why:
            raise UnsafeArchiveError(
                f"refusing to extract {archive}: with its members in place, the link "
                f"{str(path)!r} -> {target!r} already in {dest} would point outside it ({why})"
            )
    for path, target in listing.hardlinks.items():
        why = _escape(links, PurePosixPath(), target)
        if why:
            raise _refuse(archive, listing.members[path], f"is a hard link to {target!r}, {why}")


def _check_not_through_links(
    archive: Path, members: dict[PurePosixPath, str], links: set[PurePosixPath]
) -> None:
    # A member under a symlinked directory is written wherever the link points.
    for path, member in members.items():
        through = next((p for p in path.parents if p in links), None)
        if through is not None:
            raise _refuse(archive, member, f"lies inside the symlink {str(through)!r}")


def _untar(archive: Path, tmp: Path, dest: Path, protected: set[str]) -> None:
    with tarfile.open(archive) as tar:
        infos = tar.getmembers()
        listing = _Listing()
        for info in infos:
            path = _member_path(archive, info.name, info.isdir(), protected)
            listing.add(path, info.name, info.isdir())
            if info.issym():
                _check_link(archive, info.name, info.linkname, path.parent)
                listing.links[path] = info.linkname
            elif info.islnk():  # hard link names are relative to the archive root
                _check_link(archive, info.name, info.linkname, PurePosixPath("."))
                listing.hardlinks[path] = info.linkname
            elif not (info.isfile() or info.isdir()):
                raise _refuse(archive, info.name, "is a device or fifo")
        _check_listing(archive, dest, listing)
        # Defence in depth: the stdlib's data filter also checks links as resolved on disk (Python
        # 3.12, and the 3.8-3.11 security releases of 2023 on).
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        try:
            tar.extractall(tmp, members=infos, **kwargs)
        except getattr(tarfile, "FilterError", ()) as e:
            raise _refuse(
                archive, e.tarinfo.name, f"was refused by tarfile's data filter: {e}"
            ) from e


def _unzip(archive: Path, tmp: Path, dest: Path, protected: set[str]) -> None:
    with zipfile.ZipFile(archive) as zf:
        listing = _Listing()
        for info in zf.infolist():
            path = _member_path(archive, info.filename, info.is_dir(), protected)
            if stat.S_ISLNK(info.external_attr >> 16):
                # A zip's links are refused outright: a chain of them ('l2 -> .', then a link
                # through l2/l2/..) reaches any file, and no dataset needs them.
                raise _refuse(
                    archive,
                    info.filename,
                    f"is a symbolic link (to {zf.read(info)[:200].decode('utf-8', 'replace')!r}); "
                    "links in zip archives are refused, as they can lead out of the dataset "
                    "directory: repack the archive without links (or as a tar)",
                )
            listing.add(path, info.filename, info.is_dir())
        _check_listing(archive, dest, listing)
        zf.extractall(tmp)


def _merge_into(src: Path, dst: Path) -> None:
    # Directories merge, so two archives sharing a top-level folder don't erase each other.
    for entry in src.iterdir():
        target = dst / entry.name
        if (
            entry.is_dir()
            and not entry.is_symlink()
            and target.is_dir()
            and not target.is_symlink()
        ):
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
            _unzip(archive, tmp, dest, protected)
        elif tarfile.is_tarfile(archive):
            _untar(archive, tmp, dest, protected)
        else:
            raise ManifestError(
                f"{manifest.path}: {archive.name} has extract: true but is neither "
                "a tar nor a zip archive",
                manifest.path,
            )
        _merge_into(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
