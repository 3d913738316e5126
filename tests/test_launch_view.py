"""What a launch shows: in a real kernel, `wb.launch` displays a line that follows the run while the cell blocks
and ends as the run's summary; `Run`/`RunResult` read as one line; `wb.runs` lists past runs, `wb.compare`
overlays them."""

from __future__ import annotations

import html
import re
import time
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from workbench.rundir import RunDir


def _kernel_messages(code: str, deadline_s: float = 100.0) -> tuple[list[dict[str, Any]], str]:
    """Run `code` in a fresh python3 kernel; its iopub messages up to the cell's end, and its status."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")
    try:
        msg_id = client.execute(code)
        messages, status = [], "?"
        deadline = time.monotonic() + deadline_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(
                    f"the cell did not end within {deadline_s:.0f} s; last messages: {messages[-3:]}"
                )
            msg = client.get_iopub_msg(timeout=left)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append(
                {
                    "type": msg["msg_type"],
                    **msg["content"],
                    "at": time.monotonic(),
                    # the kernel's clock when it sent the message (time.time() in the cell's)
                    "sent": msg["header"]["date"].timestamp(),
                }
            )
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        status = client.get_shell_msg(timeout=30)["content"]["status"]
        return messages, status
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _text(message: dict[str, Any]) -> str:
    return " ".join(
        html.unescape(re.sub(r"<[^>]+>", " ", message.get("data", {}).get("text/html", ""))).split()
    )


def _called_at(messages: list[dict[str, Any]], mark: str) -> float:
    """The time.time() the cell printed as `mark <seconds>` right before its call."""
    text = "".join(m["text"] for m in messages if m["type"] == "stream")
    found = re.search(rf"{mark} ([\d.]+)", text)
    assert found, f"the cell printed no {mark!r}: {text[-500:]}"
    return float(found.group(1))


def _lines(messages: list[dict[str, Any]], display_id: str) -> list[dict[str, Any]]:
    return [
        m
        for m in messages
        if m["type"] in ("display_data", "update_display_data")
        and m["transient"]["display_id"] == display_id
    ]


PHASE = re.compile(r"data-phase='([^']+)'")


def _phases_in_order(shown: list[dict[str, Any]]) -> list[str]:
    """The phases the line went through, each once, in the order it first showed them."""
    seen: list[str] = []
    for m in shown:
        found = PHASE.search(m["data"]["text/html"])
        if found and found.group(1) not in seen:
            seen.append(found.group(1))
    return seen


@pytest.mark.slow
def test_a_launch_in_a_kernel_says_its_phase_at_once_then_follows_the_run_to_its_summary(
    runs_dir: Path,
) -> None:
    """Within 0.5 s of `wb.launch(...)` the line says what the launch does (checking, preparing
    data, starting 2 processes: each announced where that work happens) with the time since the
    call, then the training line takes over and ends as the summary. `wb.start` speaks as soon, and
    its line follows the run it returned to its end."""
    code = (
        f"import time\n"
        f"import workbench as wb\n"
        # 1,500 steps, 6 s or more: updates (one a second) see it running on any machine
        f"cfg = wb.RunConfig(task='digits', num_processes=2, max_steps=1500, log_every=50, "
        f"runs_dir={str(runs_dir)!r}, run_name='live')\n"
        f"print('launch-called', time.time(), flush=True)\n"
        f"result = wb.launch(cfg)\n"
        f"print('start-called', time.time(), flush=True)\n"
        f"run = wb.start(cfg.replace(run_name='started', max_steps=20, log_every=5))\n"
        f"run.wait()\n"
        # the start's line follows the run from its own thread: its last update, a second on
        f"time.sleep(2.5)\n"
    )
    messages, status = _kernel_messages(code, deadline_s=150)
    assert status == "ok", [m for m in messages if m["type"] == "error"]
    displays = [m for m in messages if m["type"] == "display_data"]
    assert len(displays) == 2, "one line per launch, then updates to it"
    launch_id, start_id = (m["transient"]["display_id"] for m in displays)
    shown = _lines(messages, launch_id)
    assert shown[0]["type"] == "display_data"
    # at once: the call's first line, before torch even loads
    delay = shown[0]["sent"] - _called_at(messages, "launch-called")
    assert delay < 0.5, f"the line came {delay:.2f} s after the call"
    assert _text(shown[0]).startswith("live checking · 0.")
    phases = _phases_in_order(shown)
    assert phases == ["checking", "preparing data", "starting 2 processes"], phases
    # each phase line has the time since the call, counting up
    elapsed = [
        float(m.group(1))
        for s in shown
        if (m := re.search(r" · ([\d.]+) s$", _text(s))) and PHASE.search(s["data"]["text/html"])
    ]
    assert elapsed == sorted(elapsed) and len(elapsed) >= 3, elapsed
    # then the training line, never a phase again
    first_training = next(
        i for i, m in enumerate(shown) if "data-status='running'" in m["data"]["text/html"]
    )
    assert not any(PHASE.search(m["data"]["text/html"]) for m in shown[first_training:])
    running = [_text(m) for m in shown[first_training:] if "'running'" in m["data"]["text/html"]]
    assert any(
        re.search(r"step \d+/1500 \(\d+%\) · ETA .* · loss [\d.]+ · [\d.]+ ms/step", t)
        for t in running
    ), f"no update while it ran: {[_text(m) for m in shown]}"
    final = _text(shown[-1])
    assert "live completed" in final and "step 1500/1500 (100%) · completed in" in final
    assert re.search(r"eval accuracy [\d.]+", final) and re.search(r"[\d,]+ samples/s", final), (
        final
    )
    assert not [m for m in messages if m["type"] == "stream" and m["text"].strip() == ""], (
        "no blank lines"
    )
    started = _lines(messages, start_id)
    delay = started[0]["sent"] - _called_at(messages, "start-called")
    assert delay < 0.5 and _text(started[0]).startswith("started checking · 0."), (
        delay,
        _text(started[0]),
    )
    assert "starting 2 processes" in _phases_in_order(started)
    assert "started completed" in _text(started[-1]), [_text(m) for m in started]


def test_progress_false_shows_nothing_in_a_kernel(runs_dir: Path) -> None:
    code = (
        f"import workbench as wb\n"
        f"wb.launch(wb.RunConfig(task='digits', num_processes=2, max_steps=10, runs_dir={str(runs_dir)!r}), "
        f"progress=False)\n"
    )
    messages, status = _kernel_messages(code)
    assert status == "ok"
    assert not [m for m in messages if m["type"] in ("display_data", "update_display_data")]


def test_run_and_result_read_as_one_line_without_private_fields(runs_dir: Path) -> None:
    cfg = wb.RunConfig(
        task="digits",
        num_processes=2,
        max_steps=10,
        log_every=5,
        runs_dir=str(runs_dir),
        run_name="short",
    )
    run = wb.start(cfg)
    try:
        assert re.fullmatch(
            r"<Run short (starting|running|completed): step \d+/10(, loss [\d.]+)?>", repr(run)
        )
        result = run.wait()
    finally:
        if not run.done():
            run.kill()
    assert re.fullmatch(
        r"<RunResult short completed: step 10/10, loss \d\.\d{1,3}>", repr(result)
    ), repr(result)
    assert repr(run).replace("<Run ", "<RunResult ") == repr(result)
    assert "_mode" not in repr(run) and len(repr(result)) < 80
    assert re.search(
        r"<b>short</b> <span style='color:#2e7d32'>completed:</span> step 10/10, loss [\d.]+",
        result._repr_html_(),
    )


def test_wb_runs_lists_past_runs_newest_first_and_compare_overlays_them(runs_dir: Path) -> None:
    base = dict(task="digits", num_processes=2, max_steps=10, log_every=5, runs_dir=str(runs_dir))
    wb.launch(wb.RunConfig(**base, run_name="first"), progress=False)
    wb.launch(wb.RunConfig(**base, run_name="second", precision="bf16"), progress=False)
    (runs_dir / "not-a-run").mkdir()
    table = wb.runs(runs_dir)
    assert table.names == ["second", "first"]
    text = repr(table).splitlines()
    assert text[0].split() == [
        "name",
        "status",
        "task",
        "layout",
        "precision",
        "steps",
        "loss",
        "eval",
        "samples/s",
        "started",
    ]
    assert re.match(
        r"second\s+completed\s+digits\s+ddp x 2\s+bf16\s+10\s+[\d.]+\s+loss [\d.]+, accuracy [\d.]+",
        text[1],
    ), text[1]
    assert "data-run='first'" in table._repr_html_()
    assert table["first"].summary["precision"] == "fp32" and table[0].run_dir.name == "second"
    with pytest.raises(
        KeyError, match=r"'third': no run of that name in .* \(it has 2: second, first\)"
    ):
        table["third"]
    figure = wb.compare(table[0], runs_dir / "first")
    labels = {line.get_label().split(" (")[0] for ax in figure.axes for line in ax.get_lines()}
    assert {"second", "first"} <= labels, labels
    with pytest.raises(ValueError, match="compare\\(\\): no metrics.jsonl in .*not-a-run"):
        wb.compare(runs_dir / "not-a-run")
    with pytest.raises(ValueError, match=r"runs_dir='nowhere': no such folder"):
        wb.runs("nowhere")
    assert wb.Dashboard(table[0]).status == "completed"
    assert RunDir(runs_dir / "first").last_train_row()["step"] == 10


def test_a_dropped_line_printed_in_two_writes_leaves_nothing_behind() -> None:
    """print() writes accelerate's 'Launching training on 2 CPUs.' and its newline apart: both go."""
    import contextlib
    import io

    from workbench.launcher.supervisor import DropLines

    out = io.StringIO()
    with contextlib.redirect_stdout(DropLines(out, ("Launching training on",))):
        print("Launching training on 2 CPUs.")
        print("[rank 0] kept")
        print("Launch", end="")
        print("ed: kept too")
        print("\rprogress 1/2", end="")
    assert out.getvalue() == "[rank 0] kept\nLaunched: kept too\n\rprogress 1/2"
