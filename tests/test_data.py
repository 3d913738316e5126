"""Tests for workbench.data: manifests, verified resolution, offline behaviour.

All offline: the tinyshakespeare mirror is ../shared/data beside the repository
(or WORKBENCH_TEST_MIRROR), and every cache is a fresh tmp_path.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import filelock
import pytest
import yaml

from workbench import data
from workbench.data import DataUnavailableError, IntegrityError, ManifestError, UnsafeArchiveError

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE_SHA = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
DIGITS_SHA = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
SYNTHETIC_SHA = "35a62a18ff004a3e77b9617ff10f9811e9d3fed1bb1a30b1d4d419679b9a10c9"
DEAD_URL = "http://127.0.0.1:9/x"  # discard port: refused at once, never leaves the machine


def sha256(path_or_bytes: Path | bytes) -> str:
    raw = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    return hashlib.sha256(raw).hexdigest()


def rejected(expected: str, where_regex: str, actual_regex: str) -> str:
    """Pattern for an IntegrityError showing both digests and where the bad copy came from."""
    return rf"(?s)expected sha256 {expected}.*{where_regex}: corrupt: got sha256 {actual_regex}"


def rejected_locally(expected: str, where_regex: str, path_regex: str, which: str) -> str:
    """Pattern for an IntegrityError about a local copy (a mirror's, a package's, a file:// URL's):
    where it came from, what differs and where to look; the tests assert the file's own digest is
    absent."""
    return (
        rf"(?s)expected sha256 {expected}.*{where_regex}: corrupt: its {which} differs from the "
        rf"manifest's \(compare `sha256sum {path_regex}` with it\)"
    )


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test sees the user's cache, mirrors, manifests, offline setting, or a proxy."""
    for var in (
        "WORKBENCH_DATA_MIRROR",
        "WORKBENCH_OFFLINE",
        "WORKBENCH_MANIFESTS",
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "*")
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(tmp_path / "default-cache"))
    data.reset_used_datasets()
    yield
    data.reset_used_datasets()


@pytest.fixture(scope="session")
def mirror() -> Path:
    env = os.environ.get("WORKBENCH_TEST_MIRROR")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    if not (root / "tinyshakespeare" / "input.txt").is_file():
        pytest.skip(
            f"no tinyshakespeare mirror at {root}/tinyshakespeare/input.txt "
            "(set WORKBENCH_TEST_MIRROR to a directory holding tinyshakespeare/input.txt)"
        )
    return root


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def write_manifest(directory: Path, stem: str, files: list[dict], **top) -> Path:
    """Write <directory>/<stem>.yaml; `top` overrides or adds top-level keys."""
    directory.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema_version": 1,
        "name": stem,
        "version": "1",
        "description": f"test dataset {stem}",
        "license": "CC0-1.0",
        "homepage": "",
        "files": files,
        **top,
    }
    path = directory / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def mirrored_file(tmp_path: Path, name: str, filename: str, content: bytes) -> dict:
    """Put content in a tmp mirror as <name>/<filename>; return its manifest `files` entry."""
    target = tmp_path / "mirror" / name / filename
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content)
    return {"path": filename, "urls": [DEAD_URL], "sha256": sha256(content), "size": len(content)}


# --------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------


def test_builtin_manifests_declare_the_shipped_datasets():
    manifests = {m.name: m for m in data.list_manifests()}
    assert {"tinyshakespeare", "digits", "synthetic-regression"} <= set(manifests)
    assert [m.name for m in data.list_manifests()] == sorted(manifests)

    shakespeare = manifests["tinyshakespeare"]
    assert (shakespeare.source, len(shakespeare.files)) == ("url", 1)
    spec = shakespeare.files[0]
    assert (spec.path, spec.size, spec.sha256, spec.urls) == (
        "input.txt",
        1115394,
        SHAKESPEARE_SHA,
        (SHAKESPEARE_URL,),
    )
    assert shakespeare.license and shakespeare.homepage.startswith("https://")
    assert shakespeare.path == data.MANIFEST_DIR / "tinyshakespeare.yaml"

    digits = manifests["digits"].files[0]
    assert (manifests["digits"].source, digits.package, digits.resource) == (
        "package",
        "sklearn",
        "datasets/data/digits.csv.gz",
    )
    assert manifests["synthetic-regression"].source == "synthetic"


def test_describe_is_readable():
    text = data.load_manifest("tinyshakespeare").describe()
    assert text.splitlines()[0] == "tinyshakespeare (version 1)"
    for expected in (
        "license:",
        "homepage: https://github.com/karpathy/char-rnn",
        "input.txt  1,115,394 bytes",
        SHAKESPEARE_SHA,
        SHAKESPEARE_URL,
        str(data.MANIFEST_DIR / "tinyshakespeare.yaml"),
    ):
        assert expected in text
    assert (
        "generated by linear-regression(seed=0, n_samples=1024"
        in data.load_manifest("synthetic-regression").describe()
    )


def test_unknown_dataset_lists_known_names():
    with pytest.raises(
        ManifestError, match=r"unknown dataset 'nope'; known datasets: .*digits.*tinyshakespeare"
    ):
        data.load_manifest("nope")


GOOD_FILE = {"path": "a.txt", "urls": ["https://example.org/a.txt"], "sha256": "0" * 64, "size": 1}


@pytest.mark.parametrize(
    "top, files, pattern",
    [
        ({"colour": "red"}, [GOOD_FILE], r"unknown key 'colour'"),
        ({"licence": "MIT"}, [GOOD_FILE], r"unknown key 'licence'"),
        ({}, [{**GOOD_FILE, "sha265": "0" * 64}], r"unknown key 'sha265' in files\[0\] \(a\.txt\)"),
        (
            {},
            [{k: v for k, v in GOOD_FILE.items() if k != "sha256"}],
            r"missing required key 'sha256' in files\[0\]",
        ),
        (
            {},
            [{**GOOD_FILE, "sha256": "abc"}],
            r"sha256 in files\[0\] \(a\.txt\) must be 64 hexadecimal characters",
        ),
        (
            {},
            [{**GOOD_FILE, "size": -1}],
            r"size in files\[0\] \(a\.txt\) must be a non-negative integer",
        ),
        (
            {},
            [{**GOOD_FILE, "size": "1"}],
            r"size in files\[0\] \(a\.txt\) must be a non-negative integer",
        ),
        (
            {},
            [{**GOOD_FILE, "urls": []}],
            r"urls in files\[0\] \(a\.txt\) must be a non-empty list",
        ),
        ({}, [{**GOOD_FILE, "path": "../a.txt"}], r"path in files\[0\] .* must be a relative path"),
        (
            {},
            [{**GOOD_FILE, "path": "/etc/a.txt"}],
            r"path in files\[0\] .* must be a relative path",
        ),
        ({}, [GOOD_FILE, GOOD_FILE], r"file path 'a\.txt' is declared more than once"),
        ({"schema_version": 2}, [GOOD_FILE], r"schema_version must be 1"),
        ({"source": "ftp-site"}, [GOOD_FILE], r"source must be one of url, package, synthetic"),
        (
            {"source": "synthetic"},
            [{"path": "a.csv", "generator": "nope"}],
            r"generator in files\[0\] .* must be one of: .*gaussian-blobs",
        ),
        (
            {"source": "synthetic"},
            [{"path": "a.csv", "generator": "gaussian-blobs", "params": {"n_points": 3}}],
            r"unknown generator parameter 'n_points'",
        ),
        (
            {"source": "package"},
            [GOOD_FILE],
            r"unknown key 'urls' in files\[0\].*\n.*missing required keys 'package', 'resource'",
        ),
    ],
    ids=[
        "unknown-top-key",
        "unknown-top-key-2",
        "unknown-file-key",
        "no-sha256",
        "short-sha256",
        "negative-size",
        "size-a-string",
        "empty-urls",
        "path-dotdot",
        "path-absolute",
        "path-twice",
        "schema-version-2",
        "unknown-source",
        "unknown-generator",
        "unknown-generator-param",
        "package-source-with-urls",
    ],
)
def test_invalid_manifest_names_problem_and_file(tmp_path, top, files, pattern):
    path = write_manifest(tmp_path / "manifests", "bad", files, **top)
    with pytest.raises(ManifestError, match=pattern) as info:
        data.load_manifest("bad", extra_dirs=[path.parent])
    assert str(path) in str(info.value)
    assert info.value.path == path


def test_missing_required_keys_are_all_named(tmp_path):
    path = tmp_path / "manifests" / "bad.yaml"
    path.parent.mkdir()
    path.write_text("schema_version: 1\nname: bad\nfiles: []\n")
    with pytest.raises(
        ManifestError,
        match=r"missing required keys 'description', 'license', 'homepage', 'version'",
    ) as info:
        data.load_manifest("bad", extra_dirs=[path.parent])
    assert re.search(rf"invalid data manifest {re.escape(str(path))}", str(info.value))


def test_name_must_match_file_name(tmp_path):
    path = write_manifest(tmp_path / "m", "right", [GOOD_FILE], name="wrong")
    with pytest.raises(
        ManifestError,
        match=rf"{re.escape(str(path))}:\n  - name 'wrong' must match the file name 'right\.yaml'",
    ):
        data.load_manifest("right", extra_dirs=[path.parent])


def test_user_manifest_overrides_builtin_with_warning(tmp_path, monkeypatch, caplog):
    user = write_manifest(tmp_path / "mine", "tinyshakespeare", [GOOD_FILE], version="2")
    monkeypatch.setenv(
        "WORKBENCH_MANIFESTS", os.pathsep.join([str(tmp_path / "absent"), str(user.parent)])
    )
    with caplog.at_level(logging.WARNING, logger="workbench"):
        manifest = data.load_manifest("tinyshakespeare")
    assert (manifest.version, manifest.path) == ("2", user)
    assert re.search(
        rf"using {re.escape(str(user))}, which overrides .*data-manifests", caplog.text
    )
    assert data.manifest_dirs()[:2] == [tmp_path / "absent", user.parent]
    # An extra_dirs argument outranks the environment.
    arg = write_manifest(tmp_path / "arg", "tinyshakespeare", [GOOD_FILE], version="3")
    assert data.load_manifest("tinyshakespeare", extra_dirs=[arg.parent]).version == "3"
    # a lone path is fine
    assert data.load_manifest("tinyshakespeare", extra_dirs=str(arg.parent)).version == "3"


# --------------------------------------------------------------------------
# Resolving url datasets through cache and mirrors
# --------------------------------------------------------------------------


def test_resolve_from_mirror_then_from_cache(mirror, cache, monkeypatch):
    monkeypatch.setenv(
        "WORKBENCH_DATA_MIRROR", os.pathsep.join(["/nonexistent-mirror", str(mirror)])
    )
    first = data.resolve("tinyshakespeare", cache=cache, offline=True, progress=False)
    assert first.root == cache / "tinyshakespeare" / "1"
    assert first["input.txt"] == cache / "tinyshakespeare" / "1" / "input.txt"
    assert first.origins == {"input.txt": str(mirror / "tinyshakespeare" / "input.txt")}
    assert sha256(first["input.txt"]) == SHAKESPEARE_SHA
    assert first.record() == {
        "name": "tinyshakespeare",
        "version": "1",
        "source": "url",
        "files": {"input.txt": SHAKESPEARE_SHA},
    }
    json.dumps(first.record())

    monkeypatch.delenv("WORKBENCH_DATA_MIRROR")
    monkeypatch.setenv("WORKBENCH_OFFLINE", "1")
    second = data.resolve("tinyshakespeare", cache=cache, progress=False)
    assert second.origins == {"input.txt": "cache"}
    assert second.record() == first.record()
    assert data.used_datasets() == [first.record()]  # deduplicated by name


def test_default_cache_comes_from_environment(mirror, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(tmp_path / "env-cache"))
    assert data.cache_dir() == tmp_path / "env-cache"
    resolved = data.fetch("tinyshakespeare", mirrors=[mirror], offline=True, progress=False)
    assert resolved.root == tmp_path / "env-cache" / "tinyshakespeare" / "1"
    monkeypatch.delenv("WORKBENCH_DATA_DIR")
    assert data.cache_dir().parts[-2:] == ("workbench", "data")


def test_copied_cache_works_as_a_mirror(mirror, tmp_path):
    elsewhere = data.resolve(
        "tinyshakespeare",
        cache=tmp_path / "other-machine",
        mirrors=[mirror],
        offline=True,
        progress=False,
    )
    here = data.resolve(
        "tinyshakespeare",
        cache=tmp_path / "cache",
        mirrors=[tmp_path / "other-machine"],
        offline=True,
        progress=False,
    )
    assert here.origins["input.txt"] == str(elsewhere["input.txt"])


def test_corrupt_mirror_file_is_rejected_naming_it_without_its_digest(mirror, tmp_path, cache):
    content = bytearray((mirror / "tinyshakespeare" / "input.txt").read_bytes())
    content[1000] ^= 0x01
    bad = tmp_path / "bad-mirror" / "tinyshakespeare" / "input.txt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(bytes(content))

    with pytest.raises(
        IntegrityError,
        match=rejected_locally(
            SHAKESPEARE_SHA, f"mirror {re.escape(str(bad))}", re.escape(str(bad)), "sha256"
        ),
    ) as info:
        data.resolve(
            "tinyshakespeare", cache=cache, mirrors=[bad.parents[1]], offline=True, progress=False
        )
    assert sha256(bytes(content)) not in str(info.value)
    assert (info.value.expected, info.value.actual) == (SHAKESPEARE_SHA, None)
    assert [f for f in files_under(cache) if not f.endswith(".lock")] == []
    assert data.used_datasets() == []


def test_corrupt_cache_file_is_replaced_from_mirror(mirror, cache, caplog):
    cached = data.resolve(
        "tinyshakespeare", cache=cache, mirrors=[mirror], offline=True, progress=False
    )["input.txt"]
    with open(cached, "r+b") as f:
        f.seek(10)
        f.write(b"#")
    corrupt_sha = sha256(cached)

    with caplog.at_level(logging.WARNING, logger="workbench"):
        again = data.resolve(
            "tinyshakespeare", cache=cache, mirrors=[mirror], offline=True, progress=False
        )
    assert again.origins["input.txt"] == str(mirror / "tinyshakespeare" / "input.txt")
    assert sha256(cached) == SHAKESPEARE_SHA
    assert f"expected sha256 {SHAKESPEARE_SHA}, got {corrupt_sha}" in caplog.text


def test_corrupt_cache_without_other_source_fails_with_both_digests(mirror, cache):
    cached = data.resolve(
        "tinyshakespeare", cache=cache, mirrors=[mirror], offline=True, progress=False
    )["input.txt"]
    cached.write_bytes(b"not shakespeare")
    pattern = rejected(
        SHAKESPEARE_SHA, f"cache {re.escape(str(cached))}", sha256(b"not shakespeare")
    )
    with pytest.raises(IntegrityError, match=pattern):
        data.resolve("tinyshakespeare", cache=cache, mirrors=[], offline=True, progress=False)


# --------------------------------------------------------------------------
# Offline and failing downloads
# --------------------------------------------------------------------------


def test_offline_without_mirror_explains_how_to_provide_data(cache, monkeypatch):
    expected = (
        r"(?s)dataset 'tinyshakespeare' is not available.*"
        rf"{re.escape(SHAKESPEARE_URL)}: skipped: offline.*"
        r"WORKBENCH_DATA_MIRROR=/path/to/mirror, holding /path/to/mirror/tinyshakespeare/input\.txt.*"
        r"workbench data fetch tinyshakespeare"
    )
    with pytest.raises(DataUnavailableError, match=expected):
        data.resolve("tinyshakespeare", cache=cache, mirrors=[], offline=True, progress=False)
    monkeypatch.setenv("WORKBENCH_OFFLINE", "1")
    with pytest.raises(DataUnavailableError, match=expected):
        data.resolve("tinyshakespeare", cache=cache, progress=False)


def test_failed_download_names_url_and_reason(tmp_path, cache):
    write_manifest(
        tmp_path / "m",
        "remote",
        [{"path": "x.txt", "urls": [DEAD_URL], "sha256": "0" * 64, "size": 3}],
    )
    with pytest.raises(
        DataUnavailableError,
        match=(
            r"(?s)dataset 'remote' is not available: no copy of x\.txt.*"
            r"mirrors: none configured.*"
            rf"{re.escape(DEAD_URL)}: [^\n]*(refused|Errno)[^\n]*\n.*"
            r"WORKBENCH_DATA_MIRROR"
        ),
    ) as info:
        data.resolve(
            "remote",
            extra_dirs=[tmp_path / "m"],
            cache=cache,
            mirrors=[],
            offline=False,
            progress=False,
        )
    assert "Traceback" not in str(info.value)


def test_download_is_verified_and_shows_progress_on_stderr(tmp_path, cache, capsys):
    source = tmp_path / "server" / "blob.bin"
    source.parent.mkdir()
    source.write_bytes(b"payload" * 1000)
    url = source.as_uri()
    entry = {"path": "blob.bin", "urls": [DEAD_URL, url], "sha256": sha256(source), "size": 7000}
    write_manifest(tmp_path / "m", "remote", [entry])

    resolved = data.resolve(
        "remote", extra_dirs=[tmp_path / "m"], cache=cache, mirrors=[], offline=False, progress=True
    )
    assert resolved.origins == {"blob.bin": url}
    assert resolved["blob.bin"].read_bytes() == source.read_bytes()
    out, err = capsys.readouterr()
    assert out == ""
    assert "remote/blob.bin" in err


def test_file_url_with_wrong_digest_is_never_used_nor_its_digest_shown(tmp_path, cache):
    source = tmp_path / "server" / "blob.bin"
    source.parent.mkdir()
    source.write_bytes(b"tampered")
    expected = sha256(b"original")
    write_manifest(
        tmp_path / "m",
        "remote",
        [{"path": "blob.bin", "urls": [source.as_uri()], "sha256": expected, "size": 8}],
    )
    with pytest.raises(
        IntegrityError,
        match=rejected_locally(
            expected, re.escape(source.as_uri()), re.escape(str(source)), "sha256"
        ),
    ) as info:
        data.resolve(
            "remote",
            extra_dirs=[tmp_path / "m"],
            cache=cache,
            mirrors=[],
            offline=False,
            progress=False,
        )
    assert sha256(b"tampered") not in str(info.value)
    assert info.value.actual is None
    assert [f for f in files_under(cache) if not f.endswith(".lock")] == []


def test_oversized_download_is_cut_off(tmp_path, cache):
    source = tmp_path / "server" / "blob.bin"
    source.parent.mkdir()
    source.write_bytes(b"x" * 100)
    write_manifest(
        tmp_path / "m",
        "remote",
        [{"path": "blob.bin", "urls": [source.as_uri()], "sha256": "0" * 64, "size": 10}],
    )
    with pytest.raises(
        IntegrityError, match=r"corrupt: more than the expected 10 bytes \(stopped reading\)"
    ):
        data.resolve(
            "remote",
            extra_dirs=[tmp_path / "m"],
            cache=cache,
            mirrors=[],
            offline=False,
            progress=False,
        )


# --------------------------------------------------------------------------
# Archives
# --------------------------------------------------------------------------


def tar_bytes(*members: tarfile.TarInfo | tuple[str, bytes]) -> bytes:
    """A .tar.gz of `members`, the same bytes every time (gzip's header would hold the current second)."""
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as packed,
        tarfile.open(fileobj=packed, mode="w") as tar,
    ):
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                tar.addfile(info, io.BytesIO(member[1]))
    return buf.getvalue()


def tar_link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def zip_bytes(*members: tuple[str, bytes] | tuple[str, bytes, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, content, *kind in members:
            info = zipfile.ZipInfo(name)
            if kind == ["symlink"]:
                info.external_attr = 0o120777 << 16
            zf.writestr(info, content)
    return buf.getvalue()


def archive_dataset(tmp_path: Path, filename: str, content: bytes) -> dict:
    entry = {**mirrored_file(tmp_path, "packed", filename, content), "extract": True}
    write_manifest(tmp_path / "m", "packed", [entry])
    return entry


def resolve_packed(tmp_path: Path, cache: Path) -> data.ResolvedData:
    return data.resolve(
        "packed",
        extra_dirs=[tmp_path / "m"],
        cache=cache,
        mirrors=[tmp_path / "mirror"],
        offline=True,
        progress=False,
    )


@pytest.mark.parametrize(
    "filename, archive, pattern",
    [
        (
            "a.tar.gz",
            tar_bytes(("ok.txt", b"ok"), ("../evil.txt", b"x")),
            r"member '\.\./evil\.txt' has a '\.\.' component",
        ),
        (
            "a.tar.gz",
            tar_bytes(("sub/../../evil.txt", b"x")),
            r"member 'sub/\.\./\.\./evil\.txt' has a '\.\.' component",
        ),
        (
            "a.tar.gz",
            tar_bytes(("/tmp/evil.txt", b"x")),
            r"member '/tmp/evil\.txt' has an absolute path",
        ),
        (
            "a.tar.gz",
            tar_bytes(tar_link("link", "../../outside")),
            r"member 'link' is a link to '\.\./\.\./outside', outside",
        ),
        (
            "a.tar.gz",
            tar_bytes(tar_link("link", "/etc/passwd")),
            r"member 'link' is a link to the absolute path '/etc/passwd'",
        ),
        (
            "a.tar.gz",
            tar_bytes(tar_link("hard", "../outside", tarfile.LNKTYPE)),
            r"member 'hard' is a link to '\.\./outside'",
        ),
        (
            "a.tar.gz",
            tar_bytes(tar_link("dir", "."), ("dir/x", b"x")),
            r"member 'dir/x' lies inside the symlink 'dir'",
        ),
        (
            "a.tar.gz",
            tar_bytes(("a.tar.gz", b"x")),
            r"member 'a\.tar\.gz' would overwrite 'a\.tar\.gz'",
        ),
        (
            "a.zip",
            zip_bytes(("ok.txt", b"ok"), ("../evil.txt", b"x")),
            r"member '\.\./evil\.txt' has a '\.\.' component",
        ),
        (
            "a.zip",
            zip_bytes(("/tmp/evil.txt", b"x")),
            r"member '/tmp/evil\.txt' has an absolute path",
        ),
        (
            "a.zip",
            zip_bytes(("link", b"../../outside", "symlink")),
            r"member 'link' is a symbolic link \(to '\.\./\.\./outside'\)",
        ),
        (
            "a.zip",
            zip_bytes(("link", b"/etc/passwd", "symlink")),
            r"member 'link' is a symbolic link \(to '/etc/passwd'\)",
        ),
        (
            "a.zip",
            zip_bytes(("data/x.txt", b"x"), ("data/latest", b"x.txt", "symlink")),
            r"a\.zip: member 'data/latest' is a symbolic link \(to 'x\.txt'\); links in zip archives are refused",
        ),
    ],
    ids=[
        "tar-dotdot",
        "tar-dotdot-in-middle",
        "tar-absolute",
        "tar-symlink-out",
        "tar-symlink-absolute",
        "tar-hardlink-out",
        "tar-member-inside-symlink",
        "tar-overwrites-archive",
        "zip-dotdot",
        "zip-absolute",
        "zip-symlink-out",
        "zip-symlink-absolute",
        "zip-symlink-inside",
    ],
)
def test_unsafe_archive_member_is_refused(tmp_path, cache, filename, archive, pattern):
    archive_dataset(tmp_path, filename, archive)
    with pytest.raises(UnsafeArchiveError, match=pattern):
        resolve_packed(tmp_path, cache)
    root = cache / "packed" / "1"
    # the verified archive stays cached; nothing was extracted
    assert files_under(root) == [filename]
    assert not (cache / "packed" / "evil.txt").exists() and not (cache / "evil.txt").exists()


@pytest.mark.parametrize(
    "filename, archive",
    [
        (
            "a.tar.gz",
            tar_bytes(("data/x.txt", b"x"), ("data/y.txt", b"y"), tar_link("data/latest", "x.txt")),
        ),
        ("a.zip", zip_bytes(("data/x.txt", b"x"), ("data/y.txt", b"y"))),
    ],
    ids=["tar", "zip"],
)
def test_safe_archive_is_extracted_once(tmp_path, cache, filename, archive):
    archive_dataset(tmp_path, filename, archive)
    resolved = resolve_packed(tmp_path, cache)
    links = ["data/latest"] if filename.endswith(".tar.gz") else []  # zips may hold no links
    assert files_under(resolved.root) == sorted([filename, *links, "data/x.txt", "data/y.txt"])
    assert resolved["data/x.txt"].read_bytes() == b"x"
    if links:
        assert os.readlink(resolved.root / "data" / "latest") == "x.txt"

    # Extraction is keyed on the archive's sha256: a second resolve leaves the tree alone.
    (resolved.root / "data" / "y.txt").write_bytes(b"edited")
    resolve_packed(tmp_path, cache)
    assert (resolved.root / "data" / "y.txt").read_bytes() == b"edited"


# 'l2 -> .' and then a link through l2/l2/...: '..'s that cancel the l2s as text climb out of the
# directory on disk, enough of them to reach '/' however deep the cache lies.
CHAIN = "l2/" * 40 + "../" * 40 + "etc/passwd"


@pytest.mark.parametrize(
    "filename, archive, pattern",
    [
        (
            "a.zip",
            zip_bytes(("l2", b".", "symlink"), ("passwd", CHAIN.encode(), "symlink")),
            r"refusing to extract .*a\.zip: member 'l2' is a symbolic link \(to '\.'\); links in zip archives are refused",
        ),
        (
            "a.tar.gz",
            tar_bytes(tar_link("l2", "."), tar_link("passwd", CHAIN)),
            r"a\.tar\.gz: member 'passwd' is a link to 'l2/l2/.*/etc/passwd', which leads outside .* the link\(s\) 'l2'",
        ),
        (
            "a.tar.gz",
            tar_bytes(tar_link("l2", "."), tar_link("passwd", CHAIN, tarfile.LNKTYPE)),
            r"member 'passwd' is a hard link to 'l2/l2/.*', which leads outside the dataset directory through the link",
        ),
        (
            "a.tar.gz",
            tar_bytes(tar_link("a", "b"), tar_link("b", "a")),
            r"member 'a' is a link to 'b', which goes round a loop of links \('b', 'a'\)",
        ),
    ],
    ids=["zip-symlink-chain", "tar-symlink-chain", "tar-hardlink-through-chain", "tar-loop"],
)
@pytest.mark.parametrize("data_filter", [True, False], ids=["data-filter", "no-data-filter"])
def test_a_chain_of_links_out_of_the_dataset_is_refused(
    tmp_path, cache, monkeypatch, filename, archive, pattern, data_filter
):
    if not data_filter:
        # Python 3.10 before 3.10.12 has no tarfile.data_filter: the checks alone must hold
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    archive_dataset(tmp_path, filename, archive)
    with pytest.raises(UnsafeArchiveError, match=pattern):
        resolve_packed(tmp_path, cache)
    assert files_under(cache / "packed" / "1") == [filename]  # nothing extracted, no link planted


def test_a_link_through_another_archives_link_is_refused(tmp_path, cache):
    # Each archive is harmless alone; once both are in the dataset directory, passwd would read /etc/passwd.
    first = mirrored_file(
        tmp_path, "packed", "a.tar.gz", tar_bytes(tar_link("l2", "."), ("ok.txt", b"ok"))
    )
    second = mirrored_file(tmp_path, "packed", "b.tar.gz", tar_bytes(tar_link("passwd", CHAIN)))
    write_manifest(
        tmp_path / "m", "packed", [{**first, "extract": True}, {**second, "extract": True}]
    )
    with pytest.raises(
        UnsafeArchiveError,
        match=r"b\.tar\.gz: member 'passwd' is a link to 'l2/l2/.*', which leads "
        r"outside the dataset directory through the link\(s\) 'l2'",
    ):
        resolve_packed(tmp_path, cache)
    root = cache / "packed" / "1"
    assert not (root / "passwd").is_symlink()
    assert (
        files_under(root) == ["a.tar.gz", "b.tar.gz", "ok.txt"] and os.readlink(root / "l2") == "."
    )


def test_a_link_that_another_archive_turns_outward_is_refused(tmp_path, cache):
    # The first archive's 'x -> d/../passwd' stays inside while d is a directory; the second replaces d with
    # 'd -> .', and then x is '../passwd', outside the dataset directory.
    first = mirrored_file(
        tmp_path,
        "packed",
        "a.tar.gz",
        tar_bytes(("d/keep.txt", b"k"), tar_link("x", "d/../passwd")),
    )
    second = mirrored_file(tmp_path, "packed", "b.tar.gz", tar_bytes(tar_link("d", ".")))
    write_manifest(
        tmp_path / "m", "packed", [{**first, "extract": True}, {**second, "extract": True}]
    )
    with pytest.raises(
        UnsafeArchiveError,
        match=r"b\.tar\.gz: with its members in place, the link 'x' -> "
        r"'d/\.\./passwd' already in .* would point outside it \(which leads "
        r"outside the dataset directory through the link\(s\) 'd'\)",
    ):
        resolve_packed(tmp_path, cache)
    root = cache / "packed" / "1"
    assert (root / "d").is_dir() and not (
        root / "d"
    ).is_symlink()  # the refused archive changed nothing


def test_non_archive_marked_extract_is_a_manifest_error(tmp_path, cache):
    archive_dataset(tmp_path, "plain.txt", b"just text")
    with pytest.raises(
        ManifestError, match=r"plain\.txt has extract: true but is neither a tar nor a zip archive"
    ):
        resolve_packed(tmp_path, cache)


# --------------------------------------------------------------------------
# verify()
# --------------------------------------------------------------------------


def test_verify_reports_missing_ok_and_corrupt(mirror, cache):
    [missing] = data.verify("tinyshakespeare", cache=cache)
    location = cache / "tinyshakespeare" / "1" / "input.txt"
    assert (missing.status, missing.ok, missing.location, missing.actual_sha256) == (
        "missing",
        False,
        location,
        None,
    )
    assert str(missing) == f"tinyshakespeare/input.txt  missing ({location})"

    data.resolve("tinyshakespeare", cache=cache, mirrors=[mirror], offline=True, progress=False)
    [ok] = data.verify("tinyshakespeare", cache=cache)
    assert (ok.status, ok.ok, ok.expected_sha256, ok.actual_sha256) == (
        "ok",
        True,
        SHAKESPEARE_SHA,
        SHAKESPEARE_SHA,
    )
    assert str(ok) == "tinyshakespeare/input.txt  ok"

    location.write_bytes(b"garbage")
    [corrupt] = data.verify("tinyshakespeare", cache=cache)
    assert (corrupt.status, corrupt.ok, corrupt.actual_sha256) == (
        "corrupt",
        False,
        sha256(b"garbage"),
    )
    assert str(corrupt) == (
        f"tinyshakespeare/input.txt  corrupt (expected {SHAKESPEARE_SHA[:12]}…, "
        f"got {sha256(b'garbage')[:12]}…) {location}"
    )
    assert location.read_bytes() == b"garbage"  # verify never repairs


def test_verify_all_covers_every_manifest(cache):
    checks = data.verify(cache=cache)
    assert {(c.dataset, c.path) for c in checks} >= {
        ("tinyshakespeare", "input.txt"),
        ("digits", "digits.csv.gz"),
        ("synthetic-regression", "train.csv"),
    }
    assert {c.status for c in checks} == {"missing"}


# --------------------------------------------------------------------------
# Package and synthetic sources
# --------------------------------------------------------------------------


def test_package_source_resolves_from_installed_sklearn(cache):
    import importlib.util

    bundled = (
        Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
        / "datasets"
        / "data"
        / "digits.csv.gz"
    )
    resolved = data.resolve("digits", cache=cache, mirrors=[], offline=True, progress=False)
    assert resolved.record() == {
        "name": "digits",
        "version": "1",
        "source": "package",
        "files": {"digits.csv.gz": DIGITS_SHA},
    }
    assert resolved.origins["digits.csv.gz"] == f"package sklearn ({bundled})"
    assert resolved["digits.csv.gz"].read_bytes() == bundled.read_bytes()
    assert [str(c) for c in data.verify("digits", cache=cache)] == ["digits/digits.csv.gz  ok"]


def test_digits_are_parsed_once_and_kept_beside_their_file_under_its_digest(tmp_path, monkeypatch):
    from workbench.tasks import digits

    images, labels = digits.load_digits_arrays()
    assert images.shape == (1797, 64) and labels[:5].tolist() == [0, 1, 2, 3, 4]
    parsed = tmp_path / "default-cache" / "digits" / "1" / f".digits.csv.gz.{DIGITS_SHA[:16]}.npy"
    assert parsed.is_file()

    def no_parsing(*args, **kwargs):
        raise AssertionError("parsed the CSV again")

    with monkeypatch.context() as patched:
        patched.setattr(digits.np, "loadtxt", no_parsing)
        again, _ = digits.load_digits_arrays()
    assert (again == images).all()

    # a parsed copy that can't be read is parsed again and replaced
    parsed.write_bytes(b"cut short")
    again, _ = digits.load_digits_arrays()
    assert (again == images).all() and parsed.stat().st_size > 400_000


def test_package_source_checks_digest_and_presence(tmp_path, cache):
    entry = {
        "path": "d.csv.gz",
        "package": "sklearn",
        "resource": "datasets/data/digits.csv.gz",
        "sha256": "1" * 64,
        "size": 57523,
    }
    write_manifest(tmp_path / "m", "pkg", [entry], source="package")
    with pytest.raises(
        IntegrityError,
        match=rejected_locally(
            "1" * 64, r"package sklearn \(.*digits\.csv\.gz\)", r"\S+digits\.csv\.gz", "sha256"
        ),
    ) as info:
        data.resolve("pkg", extra_dirs=[tmp_path / "m"], cache=cache, mirrors=[], progress=False)
    assert DIGITS_SHA not in str(info.value)

    write_manifest(
        tmp_path / "m", "pkg", [{**entry, "package": "no_such_package_xyz"}], source="package"
    )
    with pytest.raises(
        DataUnavailableError,
        match=r"package no_such_package_xyz: package 'no_such_package_xyz' is not installed",
    ):
        data.resolve("pkg", extra_dirs=[tmp_path / "m"], cache=cache, mirrors=[], progress=False)


def test_synthetic_source_is_deterministic(tmp_path):
    first = data.resolve("synthetic-regression", cache=tmp_path / "a", progress=False)
    second = data.resolve("synthetic-regression", cache=tmp_path / "b", progress=False)
    # pinned in the manifest, too
    assert first.sha256 == second.sha256 == {"train.csv": SYNTHETIC_SHA}
    assert first["train.csv"].read_bytes() == second["train.csv"].read_bytes()
    assert first["train.csv"].read_text().splitlines()[0] == "x0,x1,x2,x3,x4,x5,x6,x7,y"
    assert data.resolve("synthetic-regression", cache=tmp_path / "a", progress=False).origins == {
        "train.csv": "cache"
    }


def test_synthetic_without_digest_records_what_it_generated(tmp_path):
    blobs = {
        "path": "blobs.csv",
        "generator": "gaussian-blobs",
        "params": {"n_samples": 50, "centers": 2},
        "seed": 7,
    }
    tokens = {
        "path": "tokens.bin",
        "generator": "random-tokens",
        "params": {"vocab_size": 50, "length": 1000},
    }
    write_manifest(tmp_path / "m", "synth", [blobs, tokens], source="synthetic")
    kwargs = {"extra_dirs": [tmp_path / "m"], "progress": False}
    assert [
        c.status for c in data.verify("synth", extra_dirs=[tmp_path / "m"], cache=tmp_path / "a")
    ] == ["missing", "missing"]

    a = data.resolve("synth", cache=tmp_path / "a", **kwargs)
    b = data.resolve("synth", cache=tmp_path / "b", **kwargs)
    assert a.sha256 == b.sha256 and set(a.sha256) == {"blobs.csv", "tokens.bin"}
    assert a["tokens.bin"].stat().st_size == 2000
    assert a["blobs.csv"].read_text().count("\n") == 51
    assert data.resolve("synth", cache=tmp_path / "a", **kwargs).origins == {
        "blobs.csv": "cache",
        "tokens.bin": "cache",
    }
    assert [
        c.status for c in data.verify("synth", extra_dirs=[tmp_path / "m"], cache=tmp_path / "a")
    ] == ["ok", "ok"]

    # Editing params without bumping the version must not reuse the old file.
    write_manifest(tmp_path / "m", "synth", [{**blobs, "seed": 8}, tokens], source="synthetic")
    c = data.resolve("synth", cache=tmp_path / "a", **kwargs)
    assert (
        c.sha256["blobs.csv"] != a.sha256["blobs.csv"]
        and c.sha256["tokens.bin"] == a.sha256["tokens.bin"]
    )
    assert c.origins["blobs.csv"].startswith("generator gaussian-blobs")


def test_synthetic_with_wrong_digest_is_rejected(tmp_path, cache):
    entry = {
        "path": "t.bin",
        "generator": "random-tokens",
        "params": {"length": 10},
        "sha256": "2" * 64,
    }
    write_manifest(tmp_path / "m", "synth", [entry], source="synthetic")
    with pytest.raises(
        IntegrityError,
        match=rejected("2" * 64, r"generator random-tokens\(seed=0\)", "[0-9a-f]{64}"),
    ):
        data.resolve("synth", extra_dirs=[tmp_path / "m"], cache=cache, progress=False)


def test_bad_generator_params_are_a_manifest_error(tmp_path, cache):
    path = write_manifest(
        tmp_path / "m",
        "synth",
        [{"path": "t.bin", "generator": "random-tokens", "params": {"length": 0}}],
        source="synthetic",
    )
    pattern = rf"{re.escape(str(path))}: cannot generate t\.bin: generator parameter 'length' must be an integer of at least 1"
    with pytest.raises(ManifestError, match=pattern):
        data.resolve("synth", extra_dirs=[tmp_path / "m"], cache=cache, progress=False)


# --------------------------------------------------------------------------
# used_datasets() and concurrency
# --------------------------------------------------------------------------


def test_used_datasets_deduplicates_by_name(mirror, tmp_path):
    data.resolve(
        "tinyshakespeare", cache=tmp_path / "a", mirrors=[mirror], offline=True, progress=False
    )
    data.resolve("synthetic-regression", cache=tmp_path / "a", progress=False)
    data.resolve(
        "tinyshakespeare", cache=tmp_path / "b", mirrors=[mirror], offline=True, progress=False
    )
    used = data.used_datasets()
    assert [u["name"] for u in used] == ["synthetic-regression", "tinyshakespeare"]
    used[0]["files"].clear()  # callers get copies
    assert data.used_datasets()[0]["files"] == {"train.csv": SYNTHETIC_SHA}


def test_a_short_wait_for_a_dataset_lock_goes_unannounced(tmp_path, caplog, monkeypatch):
    import threading
    import time

    from workbench.data import cache

    # a loaded machine's late timer stays well inside it
    monkeypatch.setattr(cache, "QUIET_WAIT_S", 10.0)
    taken = threading.Event()

    def hold_briefly() -> None:
        with filelock.FileLock(str(tmp_path / "d.lock")):
            taken.set()
            time.sleep(0.2)

    holder = threading.Thread(target=hold_briefly)
    holder.start()
    assert taken.wait(10)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="workbench"), cache.dataset_lock(tmp_path, "d"):
        waited = time.monotonic() - start
    holder.join(10)
    assert waited >= 0.1 and "waiting for another process" not in caplog.text


RESOLVE_SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s", force=True)
from workbench.data import resolve
r = resolve("tinyshakespeare", progress=False)
print(json.dumps({"origin": r.origins["input.txt"], "sha": r.sha256["input.txt"]}))
"""


@pytest.mark.slow
def test_concurrent_processes_share_the_cache_safely(mirror, cache):
    cache.mkdir()
    env = {
        **os.environ,
        "WORKBENCH_DATA_DIR": str(cache),
        "WORKBENCH_DATA_MIRROR": str(mirror),
        "WORKBENCH_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    # Hold the dataset lock so both processes are certainly waiting on it at the same time.
    lock = filelock.FileLock(str(cache / "tinyshakespeare.lock"))
    lock.acquire()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESOLVE_SCRIPT],
            env=env,
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    try:
        for proc in procs:
            line = proc.stderr.readline()
            assert "waiting for another process" in line, line + proc.stderr.read()
    finally:
        lock.release()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))

    assert [r["sha"] for r in results] == [SHAKESPEARE_SHA, SHAKESPEARE_SHA]
    # One copied from the mirror; the other waited, then found the verified file.
    assert sorted(r["origin"] for r in results) == sorted(
        ["cache", str(mirror / "tinyshakespeare" / "input.txt")]
    )
    assert sha256(cache / "tinyshakespeare" / "1" / "input.txt") == SHAKESPEARE_SHA
    assert [f for f in files_under(cache) if not f.endswith(".lock")] == [
        "tinyshakespeare/1/input.txt"
    ]


def test_manifest_usage_is_shown_and_must_be_text(tmp_path: Path) -> None:
    assert (
        "usage:    The default corpus of the char-gpt task"
        in data.load_manifest("tinyshakespeare").describe()
    )
    bad = tmp_path / "badusage.yaml"
    text = (
        (data.MANIFEST_DIR / "tinyshakespeare.yaml")
        .read_text()
        .replace("name: tinyshakespeare", "name: badusage")
    )
    bad.write_text(re.sub(r"usage: >-\n(  .*\n)+", "usage: [1, 2]\n", text))
    with pytest.raises(
        data.ManifestError, match=r"badusage.yaml:\n  - usage must be a string, got \[1, 2\]"
    ):
        data.load_manifest("badusage", extra_dirs=[tmp_path])


DATA_PACKAGE = REPO / "workbench" / "data"


def data_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of each ``from workbench.data... import name`` in a module of workbench/data.

    Relative imports count too: in workbench/data, ``from .cache import x`` is workbench.data.cache.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level:
            anchor = ["workbench", "data"][: 3 - node.level]
            module = ".".join(anchor + ([module] if module else []))
        if module == "workbench.data" or module.startswith("workbench.data."):
            found += [(module, alias.name) for alias in node.names]
    return found


def private_imports(package: Path) -> list[str]:
    return [
        f"{p.name}: from {module} import {name}"
        for p in sorted(package.glob("*.py"))
        for module, name in data_imports(p)
        if name.startswith("_")
    ]


def test_the_private_import_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from workbench.data.cache import (\n    cache_dir,\n    _lock,\n)\n"
    )
    (tmp_path / "b.py").write_text("def f():\n    from .errors import _one_line\n")
    assert private_imports(tmp_path) == [
        "a.py: from workbench.data.cache import _lock",
        "b.py: from workbench.data.errors import _one_line",
    ]


def test_data_modules_use_only_each_others_public_interface() -> None:
    modules = sorted(DATA_PACKAGE.glob("*.py"))
    assert len(modules) >= 8
    assert private_imports(DATA_PACKAGE) == []
    # Each module declares its interface in __all__: public names it defines, and nothing
    # a sibling imports from it is left out.
    for path in modules:
        name = "workbench.data" if path.stem == "__init__" else f"workbench.data.{path.stem}"
        module = importlib.import_module(name)
        assert [n for n in module.__all__ if n.startswith("_") or not hasattr(module, n)] == [], (
            name
        )
    undeclared = [
        f"{p.name}: from {m} import {n}"
        for p in modules
        for m, n in data_imports(p)
        if n not in importlib.import_module(m).__all__
    ]
    assert undeclared == []
