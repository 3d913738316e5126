"""A data manifest's mirror on an object store (s3://bucket/prefix), against a real S3 server
(rclone `serve s3` on 127.0.0.1, tests/s3_server.py): files are fetched into the cache and verified
by sha256 as from any mirror."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest
import yaml

from tests.s3_server import S3Server, s3_server  # noqa: F401  (the fixture)
from workbench import data
from workbench.data import DataUnavailableError, IntegrityError
from workbench.data.search_paths import env_mirrors
from workbench.storage.remote import filesystem

CONTENT = b"the mirrored file's bytes\n" * 40
SHA = hashlib.sha256(CONTENT).hexdigest()
DEAD_URL = "http://127.0.0.1:9/x"  # discard port: refused at once, and offline skips it anyway


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """No test sees the user's cache, mirrors, manifests or offline setting."""
    for var in ("WORKBENCH_DATA_MIRROR", "WORKBENCH_OFFLINE", "WORKBENCH_MANIFESTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(tmp_path / "default-cache"))
    data.reset_used_datasets()
    yield
    data.reset_used_datasets()


def manifest_dir(tmp_path: Path, name: str, files: list[str]) -> Path:
    """A manifest `name` declaring each of `files` with CONTENT's digest and size."""
    folder = tmp_path / "manifests"
    folder.mkdir(exist_ok=True)
    entries = [{"path": f, "urls": [DEAD_URL], "sha256": SHA, "size": len(CONTENT)} for f in files]
    doc = {
        "schema_version": 1,
        "name": name,
        "version": "1",
        "description": f"test dataset {name}",
        "license": "CC0-1.0",
        "homepage": "",
        "files": entries,
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


def put(url: str, content: bytes) -> None:
    """An object uploaded at `url` (s3://bucket/key)."""
    fs, path = filesystem(url)
    fs.pipe_file(path, content)


def test_mirror_list_keeps_urls_beside_local_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = ["/srv/mirror", "s3://bucket/prefix/", "~/mirror", "gs://other"]
    monkeypatch.setenv("WORKBENCH_DATA_MIRROR", os.pathsep.join(entries))
    assert env_mirrors("WORKBENCH_DATA_MIRROR") == [
        Path("/srv/mirror"),
        "s3://bucket/prefix",
        Path("~/mirror").expanduser(),
        "gs://other",
    ]


def test_manifest_file_mirrored_on_s3_resolves_and_verifies(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = s3_server.bucket("datamirror") + "/team"
    put(f"{url}/mirrored/a.txt", CONTENT)
    put(f"{url}/mirrored/1/b.txt", CONTENT)  # a copied cache's layout
    manifests = manifest_dir(tmp_path, "mirrored", ["a.txt", "b.txt"])
    # beside a local folder that lacks it; offline: a configured mirror is used all the same
    monkeypatch.setenv(
        "WORKBENCH_DATA_MIRROR", os.pathsep.join([str(tmp_path / "no-such-mirror"), url])
    )
    cache = tmp_path / "cache"

    resolved = data.resolve(
        "mirrored", extra_dirs=[manifests], cache=cache, offline=True, progress=False
    )

    assert resolved.origins == {
        "a.txt": f"{url}/mirrored/a.txt",
        "b.txt": f"{url}/mirrored/1/b.txt",
    }
    assert resolved["a.txt"] == cache / "mirrored" / "1" / "a.txt"
    assert resolved["a.txt"].read_bytes() == CONTENT == resolved["b.txt"].read_bytes()
    assert resolved.sha256 == {"a.txt": SHA, "b.txt": SHA}
    again = data.resolve(
        "mirrored", extra_dirs=[manifests], cache=cache, offline=True, progress=False
    )
    assert again.origins == {"a.txt": "cache", "b.txt": "cache"}


def test_corrupted_copy_on_s3_is_refused_and_named(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
) -> None:
    url = s3_server.bucket("badmirror")
    corrupted = bytearray(CONTENT)
    corrupted[100] ^= 0x01
    put(f"{url}/corrupted/a.txt", bytes(corrupted))
    manifests = manifest_dir(tmp_path, "corrupted", ["a.txt"])
    cache = tmp_path / "cache"

    with pytest.raises(
        IntegrityError,
        match=(
            rf"(?s)no copy matches the manifest, so none was used.*expected sha256 {SHA}.*"
            rf"mirror {re.escape(url)}/corrupted/a\.txt: corrupt: got sha256 "
            rf"{hashlib.sha256(corrupted).hexdigest()}"
        ),
    ) as info:
        data.resolve(
            "corrupted",
            extra_dirs=[manifests],
            cache=cache,
            mirrors=[url],
            offline=True,
            progress=False,
        )
    assert info.value.location == f"mirror {url}/corrupted/a.txt"
    assert not (cache / "corrupted" / "1" / "a.txt").exists()
    assert data.used_datasets() == []


def test_s3_mirror_refusing_the_keys_says_which_to_set(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = s3_server.bucket("lockedmirror")
    put(f"{url}/locked/a.txt", CONTENT)
    manifests = manifest_dir(tmp_path, "locked", ["a.txt"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")

    with pytest.raises(
        DataUnavailableError,
        match=(
            rf"(?s)dataset 'locked' is not available.*mirror {re.escape(url)}/locked/a\.txt: "
            r"access denied .*set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        ),
    ) as info:
        data.resolve(
            "locked",
            extra_dirs=[manifests],
            cache=tmp_path / "cache",
            mirrors=[url],
            offline=True,
            progress=False,
        )
    assert "not-the-secret" not in str(info.value)
