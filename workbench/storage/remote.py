"""fsspec URLs for checkpoints and data: which filesystem, with which options, and whether it can be
written, asked before launch.

Credentials and the endpoint come the way boto users expect (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws): botocore reads them itself, in the launching process
and in every rank, so nothing of them is ever passed, stored in config.yaml or logged.

One setting workbench makes for the user: botocore (1.36 and newer) adds CRC checksums to every
upload and validates them on every download, which S3-compatible servers other than AWS
(rclone, MinIO and Ceph versions, ...) don't all implement: a ranged read of a checkpoint shard
then fails with "Expected checksum ... did not match". Where the endpoint isn't AWS's, checksums
are asked for only where an operation requires them (botocore's `when_required`), unless the user
set either setting.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("workbench")

CHECK_TIMEOUT_S = 10
"""Connect and read timeout of the pre-launch check (botocore's default retries a dead endpoint for
about 10 s more)."""


class StorageError(ValueError):
    """A storage URL that can't be used: which field, which URL, why, and what would work."""


def is_remote(url: str | os.PathLike[str] | None) -> bool:
    """True for an fsspec URL with a scheme other than file:// (s3://bucket/prefix, gs://...)."""
    if url is None or isinstance(url, os.PathLike):
        return False
    scheme = urlsplit(str(url)).scheme
    return len(scheme) > 1 and scheme != "file"  # "C:" is a drive, not a scheme


def check_url(field: str, url: str | None) -> None:
    """A storage URL's form, when a RunConfig is made (nothing is contacted): a scheme fsspec knows,
    a bucket, no credentials inside it. None, a plain path or file:// is a local folder."""
    if url is None or not is_remote(url):
        return
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise StorageError(
            f"{field}={_redacted(url)!r}: credentials don't go in the URL (it is saved in "
            "config.yaml and the logs); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        )
    import fsspec

    known = set(fsspec.available_protocols())
    if parts.scheme not in known:
        raise StorageError(
            f"{field}={url!r}: fsspec knows no {parts.scheme!r} protocol; use e.g. "
            "'s3://bucket/prefix', or a local path"
        )
    if not parts.netloc:
        raise StorageError(
            f"{field}={url!r}: no bucket; write it as '{parts.scheme}://bucket/prefix'"
        )


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=parts.hostname or "").geturl()


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _not_aws(endpoint: str | None) -> bool:
    if not endpoint:
        return False
    host = urlsplit(endpoint).hostname or ""
    return not host.endswith(".amazonaws.com")


def storage_options(url: str, *, check: bool = False) -> dict[str, Any]:
    """fsspec options for `url`: for s3:// on an endpoint that isn't AWS's, botocore's checksums
    only where required (see the module docstring); `check`: short timeouts and few retries, for
    the pre-launch check."""
    if urlsplit(url).scheme not in ("s3", "s3a"):
        return {}
    config: dict[str, Any] = {}
    user_set = {"AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION"} & set(
        os.environ
    )
    if _not_aws(_endpoint()) and not user_set:
        config["request_checksum_calculation"] = "when_required"
        config["response_checksum_validation"] = "when_required"
    if check:
        config.update(
            connect_timeout=CHECK_TIMEOUT_S,
            read_timeout=CHECK_TIMEOUT_S,
            retries={"max_attempts": 2, "mode": "standard"},
        )
    # a fresh client per call: credentials or the endpoint may change between runs of one kernel
    return {"config_kwargs": config, "skip_instance_cache": True} if config else {}


def configure(url: str) -> None:
    """Make storage_options(url) fsspec's defaults for the URL's protocol in this process: DCP
    builds its own filesystem from a checkpoint_id URL (url_to_fs without options), which fsspec
    then fills from its per-protocol config. Setdefault-style: a user's own fsspec config wins.
    Called in every rank and before in-kernel reads (StorePath does it on first use)."""
    options = storage_options(url)
    if not options:
        return
    import fsspec.config

    conf = fsspec.config.conf.setdefault(urlsplit(url).scheme, {})
    for key, value in options.items():
        conf.setdefault(key, value)


def filesystem(url: str, *, check: bool = False) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for `url`; StorageError naming the package to install
    when the scheme's isn't."""
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover  (fsspec comes with torch's distributed checkpoint)
        raise StorageError(f"{url}: fsspec is not installed ({e}): pip install fsspec") from None
    try:
        return fsspec.core.url_to_fs(url, **storage_options(url, check=check))
    except ImportError as e:
        scheme = urlsplit(url).scheme
        extra = (
            "workbench[s3]" if scheme in ("s3", "s3a") else f"the fsspec package for {scheme}://"
        )
        raise StorageError(f"{url}: {e}; install {extra}") from None
    except ValueError as e:
        raise StorageError(f"{url}: {e}") from None


def check_writable(url: str, field: str = "checkpoint_url") -> None:
    """Before launch: the store answers, the credentials are accepted, the bucket exists and an
    object can be written and removed under `url`. StorageError saying which and the fix."""
    fs, path = filesystem(url, check=True)
    probe = f"{path.rstrip('/')}/.workbench-probe-{os.getpid()}"
    where = f"{field}={url!r}"
    endpoint = _endpoint() or "AWS (no AWS_ENDPOINT_URL)"
    try:
        fs.pipe_file(probe, b"workbench write check\n")
        fs.rm_file(probe)
    except PermissionError as e:
        raise StorageError(
            f"{where}: the store refused the credentials or the write ({_first_line(e)}); set "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to keys that may write there"
        ) from None
    except FileNotFoundError as e:
        bucket = path.split("/", 1)[0]
        raise StorageError(
            f"{where}: {_first_line(e)} (bucket {bucket!r} at {endpoint}); create the bucket, or "
            "point the URL at one that exists"
        ) from None
    except Exception as e:  # botocore's connection errors share no base with OSError
        raise StorageError(
            f"{where}: the store at {endpoint} can't be reached or refused the write "
            f"({type(e).__name__}: {_first_line(e)}); check AWS_ENDPOINT_URL and that the server "
            "is up"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
