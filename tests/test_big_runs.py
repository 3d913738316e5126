"""Runs of many logged steps stay cheap to look at (issue 35): the last row and `workbench status` read metrics.jsonl
from its end, RunResult.metrics parses the file once (then only what was appended), and the dashboard's first view
and plot() read an even sample of a long history, not all of it. What each costs on a 200,000-row run is
`workbench bench big-run`'s to measure; these tests pin the behaviour that makes it cheap."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from workbench import rundir
from workbench.commands.status import describe_run
from workbench.launcher.result import RunResult
from workbench.notebook import reading
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.plots import LIVE_POINTS, PLOT_POINTS
from workbench.rundir import RunDir
from workbench.rundir.run_dir import TAIL_BYTES
from workbench.utils import files, jsonl

EVAL_EVERY = 500


def train_row(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "loss": 2.0 / step,
        "lr": 3e-4,
        "step_time_s": 0.01,
        "samples_per_s": 6400.0,
        "peak_memory_bytes": 300 * 2**20,
        "samples": 64 * step,
        "elapsed_s": 0.01 * (step - 1),
        "schema_version": 1,
    }


def eval_row(step: int) -> dict[str, Any]:
    return {"step": step, "eval_loss": 1.0 / step, "eval_accuracy": 0.5, "schema_version": 1}


def write_rows(path: Path, steps: int, head: bytes = b"") -> list[dict[str, Any]]:
    """`steps` training rows, an eval row every EVAL_EVERY steps, written in one go after `head`."""
    rows: list[dict[str, Any]] = []
    for step in range(1, steps + 1):
        rows.append(train_row(step))
        if step % EVAL_EVERY == 0:
            rows.append(eval_row(step))
    path.write_bytes(head + "".join(json.dumps(r) + "\n" for r in rows).encode())
    return rows


def fake_run(tmp_path: Path, steps: int, head: bytes = b"") -> tuple[Path, list[dict[str, Any]]]:
    run_dir = tmp_path / "runs" / "long-run"
    run_dir.mkdir(parents=True)
    wb.RunConfig(max_steps=steps).to_yaml(run_dir / rundir.CONFIG)
    files.write_json(
        run_dir / rundir.SUMMARY,
        {
            "status": "completed",
            "world_size": 2,
            "precision": "fp32",
            "global_batch_size": 64,
            "steps": steps,
        },
    )
    files.append_jsonl(run_dir / rundir.EVENTS, {"time": 0.0, "event": "started", "step": 0})
    return run_dir, write_rows(run_dir / rundir.METRICS, steps, head)


# ---- the last row --------------------------------------------------------------------------------
def test_status_reads_the_last_row_from_the_end_of_the_file(tmp_path: Path) -> None:
    # The head is 2,000 rows no reader could type ("step" a string): only a reader that parses them fails.
    head = b"".join(
        json.dumps({"step": "garbage", "loss": 1.0}).encode() + b"\n" for _ in range(2000)
    )
    run_dir, _ = fake_run(tmp_path, 50, head)
    text, code = describe_run(run_dir)
    assert code == 0 and "step 50/50, loss 0.04" in text


def test_the_last_training_row_is_found_however_far_back_it_is(tmp_path: Path) -> None:
    # More than one read block (TAIL_BYTES) of eval rows after the last training row.
    path = tmp_path / rundir.METRICS
    files.write_jsonl(path, [train_row(1), train_row(2)] + [eval_row(2)] * (2 * TAIL_BYTES // 60))
    assert RunDir(tmp_path).last_train_row() == train_row(2)
    # blocks cut lines
    assert [r["step"] for r in jsonl.tail_jsonl(path, block=7) if "loss" in r] == [2, 1]


@pytest.mark.parametrize("limit", [None, 800], ids=["whole", "last-800-bytes"])
def test_tail_rows_are_the_newest_first_within_the_limit(tmp_path: Path, limit: int | None) -> None:
    path = tmp_path / rundir.METRICS
    rows = [train_row(s) for s in range(1, 30)]
    files.write_jsonl(path, rows)
    with path.open("ab") as f:
        f.write(b'{"step": 30, "lo')  # a row being written: skipped
    got = list(jsonl.tail_jsonl(path, block=50, limit=limit))
    starts = [sum(len(json.dumps(x)) + 1 for x in rows[:i]) for i in range(len(rows))]
    # A line that begins before the limit is left out, not read in part; one that begins on it is read.
    first = 0 if limit is None else path.stat().st_size - limit
    assert got == [r for r, start in zip(rows, starts, strict=True) if start >= first][::-1] and got
    if limit is not None:
        on_a_line = path.stat().st_size - starts[-5]
        assert list(jsonl.tail_jsonl(path, block=50, limit=on_a_line)) == rows[-5:][::-1]


# ---- RunResult.metrics ---------------------------------------------------------------------------
def test_metrics_are_parsed_once_then_only_the_appended_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, rows = fake_run(tmp_path, 1200)
    parsed: list[int] = []
    real = jsonl._parse_whole_lines

    def counting(data: bytes, cut: int, *args: Any) -> list[dict[str, Any]]:
        parsed.append(cut)  # the bytes of whole lines parsed
        return real(data, cut, *args)

    monkeypatch.setattr(jsonl, "_parse_whole_lines", counting)
    result = RunResult.load(run_dir)
    first = result.metrics
    assert first == rows and sum(parsed) == (run_dir / rundir.METRICS).stat().st_size
    parsed.clear()
    second = result.metrics
    assert parsed == [] and second == first and second is not first  # a new list ...
    # ... of the rows parsed the first time
    assert all(a is b for a, b in zip(first, second, strict=True))
    files.append_jsonl(run_dir / rundir.METRICS, train_row(1201))  # a run still going
    third = result.metrics
    assert parsed == [len(json.dumps(train_row(1201))) + 1] and third == [*rows, train_row(1201)]
    assert third[0] is first[0]
    parsed.clear()
    # replaced whole (a resume sets rows aside): read again
    files.write_jsonl(run_dir / rundir.METRICS, rows[:10])
    assert result.metrics == rows[:10] and len(parsed) == 1


def test_metrics_keep_read_jsonl_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Chunks of 100 bytes: a bad line, a blank one and lines cut by chunks all fall back to line by line.
    monkeypatch.setattr(jsonl, "JSONL_CHUNK", 100)
    path = tmp_path / rundir.METRICS
    good = [train_row(s) for s in range(1, 6)]
    text = (
        "".join(json.dumps(r) + "\n" for r in good[:2])
        + "not json\n\n"
        + "".join(json.dumps(r) + "\n" for r in good[2:])
    )
    path.write_text(text + '{"step": 6, "loss"')  # the last line being written
    reader = jsonl.JsonlRows(path)
    with caplog.at_level(logging.WARNING, logger="workbench"):
        assert reader.read() == good
    assert [r.getMessage().split(": skipped")[0] for r in caplog.records] == [f"{path}, line 3"]
    with path.open("a") as f:
        f.write(": 0.5}\n")
    assert reader.read() == [*good, {"step": 6, "loss": 0.5}]
    # a whole last line without its end: read, not kept
    path.write_text(text + json.dumps(train_row(6)))
    assert files.read_jsonl(path) == [*good, train_row(6)]


# ---- the dashboard's first view and plot() -------------------------------------------------------
def test_the_dashboards_first_view_of_a_long_run_reads_a_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reading, "FIRST_VIEW_TAIL_BYTES", 20_000)
    run_dir, rows = fake_run(tmp_path, 6000)
    dash = Dashboard(run_dir)
    steps = [r.step for r in dash.rows]
    evals = [r.step for r in dash.rows if r.is_eval]
    newest = [r["step"] for r in rows if r["step"] >= steps[-1] - 50]
    assert len(dash.rows) <= reading.FIRST_VIEW_ROWS + 20_000 // 150 + 6000 // EVAL_EVERY
    assert steps[0] == 1 and steps[-1] == 6000 and steps == sorted(steps)
    assert evals == list(range(EVAL_EVERY, 6001, EVAL_EVERY))  # the history's evaluations too
    assert set(newest) <= set(steps)  # the newest rows, every one
    loss, smoothed = dash._figure.axes[0].get_lines()[:2]
    assert len(loss.get_xdata()) <= LIVE_POINTS and list(smoothed.get_xdata())[-1] == 6000
    assert dash.step == 6000 and "step 6000/6000" in dash.progress_text.value
    # then a poll at a time, as before
    files.append_jsonl(run_dir / rundir.METRICS, train_row(6001))
    dash.refresh()
    assert dash.rows[-1].step == 6001 and len(dash.rows) == len(steps) + 1


def test_a_bad_row_in_a_sampled_history_is_named_by_its_line(tmp_path: Path) -> None:
    path = tmp_path / rundir.METRICS
    write_rows(path, 4000, head=json.dumps({"step": "one", "loss": 1.0}).encode() + b"\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl, row 1: .*step"):
        reading.RowTail(path).read()


def test_plot_of_a_long_run_draws_a_sample(tmp_path: Path) -> None:
    run_dir, rows = fake_run(tmp_path, 3 * PLOT_POINTS)
    fig = RunResult.load(run_dir).plot()
    lines = fig.axes[0].get_lines()  # loss: raw, smoothed, eval markers
    assert all(len(line.get_xdata()) <= PLOT_POINTS for ax in fig.axes for line in ax.get_lines())
    assert list(lines[1].get_xdata())[-1] == 3 * PLOT_POINTS  # the newest row drawn
    assert list(lines[2].get_xdata()) == [r["step"] for r in rows if "eval_loss" in r]


@pytest.mark.parametrize("chunk", [64, 1 << 20], ids=["chunks-cut-lines", "one-chunk"])
def test_a_sample_is_whole_lines_first_newest_and_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(jsonl, "JSONL_CHUNK", chunk)
    path = tmp_path / rundir.METRICS
    rows = write_rows(path, 1500)
    with path.open("ab") as f:
        f.write(b'{"step": 1501')  # being written: not in the sample
    with path.open("rb") as f:
        sample = jsonl.sample_lines(f, 40, whole_tail=1000, keep=b'"eval_loss"')
    got = [json.loads(line) for _, line in sample.lines]
    assert all(row in rows for row in got) and got[0] == rows[0] and got[-1] == rows[-1]
    assert [r["step"] for r in got if "eval_loss" in r] == [500, 1000, 1500]
    assert not sample.complete and sample.end == path.stat().st_size - len(b'{"step": 1501')
    assert 40 <= len(got) <= 40 + 3 + 1000 // 100


def test_bench_big_run_times_every_reader(tmp_path: Path) -> None:
    from workbench.commands.bench.big_run import big_run

    out = tmp_path / "big-run.json"
    report = big_run(rows=400, json_path=out, keep=tmp_path)
    saved = json.loads(out.read_text())
    names = [m["name"] for m in saved["measured"]]
    assert names == [
        "status",
        "last_train_row",
        "metrics_first",
        "metrics_second",
        "plot_png",
        "dashboard_first_view",
    ]
    assert saved["measured_on"]["date"] and saved["rows"] == 400 and report.memory_ratio is not None
    assert "400 rows" in report.table()
