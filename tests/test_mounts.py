"""Which filesystem a run directory is on: a network one gets a grace period for another machine's last writes
(SlurmRun.wait), a local one doesn't."""

from __future__ import annotations

from pathlib import Path

from workbench.utils.mounts import filesystem_type, on_network_filesystem

MOUNTS = (
    "36 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
    "40 36 0:52 / /shared/home rw,relatime - nfs4 filer:/home rw,vers=4.2\n"
    "41 36 0:53 / /scratch\\040space rw - lustre 10.0.0.1@o2ib:/scratch rw\n"
    "42 36 0:54 / /mnt/remote rw - fuse.sshfs me@host: rw\n"
    "43 40 0:55 / /shared/home/local rw - ext4 /dev/sdb1 rw\n"
)


def test_the_longest_mount_point_above_the_path_gives_its_type(tmp_path: Path) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTS)
    types = {
        path: filesystem_type(path, str(table))
        for path in (
            "/home/me/runs",
            "/shared/home/me/runs",
            "/scratch space/runs",
            "/mnt/remote/x",
            "/shared/home/local/r",
            "/shared/homework",
        )
    }
    assert types == {
        "/home/me/runs": "ext4",
        "/shared/home/me/runs": "nfs4",
        "/scratch space/runs": "lustre",
        "/mnt/remote/x": "fuse.sshfs",
        "/shared/home/local/r": "ext4",
        "/shared/homework": "ext4",
    }
    assert filesystem_type("/x", str(tmp_path / "missing")) is None


def test_network_and_unknown_filesystems_are_treated_as_shared(tmp_path: Path) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTS)
    shared = {
        path: on_network_filesystem(path, str(table))
        for path in ("/shared/home/me", "/scratch space/a", "/mnt/remote/x", "/home/me")
    }
    assert shared == {
        "/shared/home/me": True,
        "/scratch space/a": True,
        "/mnt/remote/x": True,
        "/home/me": False,
    }
    assert on_network_filesystem("/anywhere", str(tmp_path / "missing")), (
        "no mount table: the careful answer"
    )
