"""Which kind of filesystem a path is on: a network filesystem (NFS, Lustre, GPFS, ...) shows
another machine's writes only after its caches let go, a local one at once."""

from __future__ import annotations

import os
import re
from pathlib import Path

NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "ceph",
        "cifs",
        "smb3",
        "smbfs",
        "beegfs",
        "glusterfs",
        "9p",
        "afs",
        "panfs",
        "wekafs",
        "orangefs",
        "pvfs2",
        "ocfs2",
        "gfs2",
        "davfs",
        "virtiofs",
    }
)
"""Filesystem types whose files other machines write (FUSE mounts count too: sshfs, s3fs,
gcsfuse...)."""


def filesystem_type(
    path: str | os.PathLike[str], mountinfo: str = "/proc/self/mountinfo"
) -> str | None:
    """The type of the filesystem `path` is on ('ext4', 'nfs4', 'fuse.sshfs', ...), from the mount
    table's longest mount point above it; None where there is no table to read (not Linux)."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    target, best, kind = os.path.realpath(path), "", None
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        # mountinfo(5): the mount point is field 5 (octal escapes for spaces); the type follows the
        # " - "
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        fstype = line.split(" - ", 1)[1].split()[0]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def on_network_filesystem(
    path: str | os.PathLike[str], mountinfo: str = "/proc/self/mountinfo"
) -> bool:
    """True for a network or FUSE filesystem, and where the mount table can't tell (the careful
    answer)."""
    kind = filesystem_type(path, mountinfo)
    return kind is None or kind in NETWORK_FILESYSTEMS or kind.startswith("fuse")
