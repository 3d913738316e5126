"""`workbench bench checkpoint`: how long a checkpoint stops training, written synchronously against
in the background (checkpoint_async), side by side in one run.

Per layout, two arms of the same run: checkpoints written whole ('sync') and written in the
background ('async'). The stall is what each checkpoint blocked the training loop for, as the
trainer measures it (summary.json's checkpoints.stall_s: the copy to host memory and the start of a
background write, or a whole synchronous write; waiting for the previous write counts too). The
final checkpoint is shown apart: the run waits for its write to end either way. The write time runs
from a checkpoint's start to its manifest; a background write shares the cores and the disk with
training while it runs, which the step time beside it shows as far as this machine's noise lets it.

With `url` (`--url s3://bucket/prefix`, or `--local-store`: an rclone server on loopback), each arm
runs twice more, its checkpoints on the store (checkpoint_url), beside the same arm on local disk:
a row per layout, store and arm. The store's endpoint and keys are the environment's (AWS_*), as
for any run; the result names the store (its URL and endpoint host, never a key).
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.launcher.launch import start
from workbench.rundir import RunDir
from workbench.storage.remote import is_remote
from workbench.storage.store_path import Location, remove_tree
from workbench.utils.files import read_json
from workbench.utils.hardware import detect, resolve_device

log = logging.getLogger("workbench")

CHECKPOINT_BENCH = RunConfig(
    task="char-gpt",
    task_options={"preset": "small"},
    num_processes=2,
    device="cpu",
    micro_batch_size=2,
    max_steps=16,
    checkpoint_every=2,
    keep_checkpoints=2,
    log_every=4,
    eval_batches=1,
    trackers=[],
)
"""char-gpt 'small' (10.7M parameters: a 130 MB checkpoint with AdamW's state) on 2 CPU ranks, a
checkpoint every other step."""
LAYOUTS = ("ddp", "zero3")
ARMS = {"sync": "off", "async": "on"}
"""Each arm's checkpoint_async."""
LOCAL = "local disk"
"""The store of an arm whose checkpoints go to the run directory's checkpoints/."""


@dataclass
class ArmRun:
    """One run of one arm."""

    layout: str
    arm: str
    stall_s: list[float]
    """Per checkpoint, in order: seconds rank 0's training loop was blocked by it (the last is the
    final one)."""
    write_s: list[float]
    """Per checkpoint: seconds from its start to its manifest."""
    step_s: list[float]
    checkpoint_mb: float
    store: str = LOCAL
    """Where its checkpoints went: LOCAL, or the checkpoint_url."""


@dataclass
class CheckpointReport:
    device: str
    config: dict[str, Any]
    runs: list[ArmRun] = field(default_factory=list)
    store: str | None = None
    """The object store beside local disk, in words (None: local disk only)."""

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One row per layout (store) and arm, as the benchmarks page shows them."""
        return [
            {
                "layout": run.layout,
                **({"store": _store_kind(run.store)} if self.store else {}),
                "writes": "background" if run.arm == "async" else "synchronous",
                "checkpoint MB": round(run.checkpoint_mb, 1),
                "checkpoints": len(run.stall_s),
                "stall per checkpoint s (median)": round(statistics.median(run.stall_s[:-1]), 3),
                "final checkpoint stall s": round(run.stall_s[-1], 3),
                "write s (median)": round(statistics.median(run.write_s), 3),
                "step s (median)": round(statistics.median(run.step_s), 3),
            }
            for run in self.runs
        ]

    @property
    def run(self) -> str:
        """The run every arm made, in words."""
        cfg = self.config
        return (
            f"{cfg['task']} {cfg['task_options']}, {cfg['num_processes']} ranks, micro-batch "
            f"{cfg['micro_batch_size']}, {cfg['max_steps']} steps, a checkpoint every "
            f"{cfg['checkpoint_every']}"
        )

    def table(self) -> str:
        store = f"{'store':11} " if self.store else ""
        lines = [
            f"workbench bench checkpoint: {self.run}, on {self.device}",
            *([f"  store: {self.store}"] if self.store else []),
            f"  {'layout':7} {store}{'writes':12} {'MB':>6} {'stall/ckpt s':>13} {'final s':>8} "
            f"{'write s':>8} {'step s':>7}",
        ]
        for row in self.rows:
            store = f"{row['store']:11} " if self.store else ""
            lines.append(
                f"  {row['layout']:7} {store}{row['writes']:12} {row['checkpoint MB']:>6.0f} "
                f"{row['stall per checkpoint s (median)']:>13.3f} "
                f"{row['final checkpoint stall s']:>8.3f} {row['write s (median)']:>8.3f} "
                f"{row['step s (median)']:>7.2f}"
            )
        lines += [
            "  stall/ckpt: the training loop blocked by a checkpoint (median over those "
            "before the last);",
            "  final: the last one, whose write the run waits for either way",
        ]
        return "\n".join(lines)


def _store_kind(store: str) -> str:
    """A row's store, short: 'local disk', or the URL's scheme ('s3')."""
    return store if store == LOCAL else f"{urlsplit(store).scheme} store"


def describe_store(url: str) -> str:
    """The store in words for the result: its URL and the endpoint's host (botocore's
    AWS_ENDPOINT_URL), loopback said as such; nothing of the credentials."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    host = urlsplit(endpoint).hostname if endpoint else None
    if host is None:
        where = "AWS (no AWS_ENDPOINT_URL)"
    elif host in ("127.0.0.1", "localhost", "::1"):
        where = f"an endpoint on this machine ({host}, loopback)"
    else:
        where = f"endpoint {host}"
    return f"{url} at {where}"


def _size_mb(where: Location | None) -> float:
    """A checkpoint's bytes, in MB: its folder's files, or the objects under its prefix."""
    if where is None:
        return 0.0
    if isinstance(where, Path):
        return sum(p.stat().st_size for p in where.rglob("*") if p.is_file()) / 1e6
    where.fs.invalidate_cache()  # the ranks wrote it, not this process's filesystem object
    return float(where.fs.du(where.path)) / 1e6


def _run_arm(cfg: RunConfig, layout: str, arm: str) -> ArmRun:
    run = start(cfg)
    try:
        result = run.wait()
    finally:
        if not run.done():
            run.kill()
    files = RunDir(result.run_dir)
    saved = [e for e in files.events() if e.get("event") == "checkpoint_saved"]
    timings = read_json(files.timings_path) or {}
    measured = ArmRun(
        layout,
        arm,
        list(result.summary["checkpoints"]["stall_s"]),
        [e["write_s"] for e in saved],
        list(timings.get("step_time_s", [])),
        _size_mb(files.latest_checkpoint()),
        cfg.checkpoint_url or LOCAL,
    )
    if cfg.checkpoint_url is not None:
        # a store outlives the bench's temporary run directories: leave nothing there
        remove_tree(files.checkpoints_path)
    return measured


def checkpoint_stall(
    cfg: RunConfig = CHECKPOINT_BENCH,
    layouts: tuple[str, ...] = LAYOUTS,
    json_path: Path | None = None,
    url: str | None = None,
    store: str | None = None,
) -> CheckpointReport:
    """Per layout, the same run with checkpoints written synchronously and in the background, and
    with `url` (an object store's, e.g. 's3://bucket/prefix') each on local disk and on the store
    (module docstring); the arms alternate their order from one layout to the next. `store`: the
    store in words for the result (default: describe_store(url))."""
    if cfg.checkpoint_every < 1 or cfg.max_steps < 2 * cfg.checkpoint_every:
        raise ValueError(
            f"checkpoint_every={cfg.checkpoint_every} with max_steps={cfg.max_steps}: "
            "the bench needs a checkpoint before the final one, e.g. "
            "checkpoint_every=2 with max_steps=16"
        )
    if url is None and is_remote(cfg.checkpoint_url):
        url = cfg.checkpoint_url  # the config's own store, beside local disk
    if url is not None and not is_remote(url):
        raise ValueError(
            f"--url {url!r}: not an object store's URL; give one such as 's3://bucket/prefix' "
            "(local disk is measured beside it anyway), or --local-store for one on this machine"
        )
    hw = detect()
    report = CheckpointReport(
        device=hw.device_line(resolve_device(cfg, hw)),
        config=cfg.to_dict(),
        store=(store or describe_store(url)) if url else None,
    )
    stores: list[str | None] = [None, url] if url else [None]
    combos = [(where, arm) for where in stores for arm in ARMS]
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        for i, layout in enumerate(layouts):
            for where, arm in combos if i % 2 == 0 else list(reversed(combos)):
                suffix = "" if where is None else "-store"
                arm_cfg = cfg.replace(
                    parallelism=layout,
                    checkpoint_async=ARMS[arm],
                    checkpoint_url=where,
                    runs_dir=tmp,
                    # a run name per bench: two benches sharing a prefix don't meet there
                    run_name=f"{layout}-{arm}{suffix}-{Path(tmp).name[-8:]}"
                    if where
                    else f"{layout}-{arm}",
                )
                preflight(arm_cfg)  # a store that can't be written is refused here, with the fix
                report.runs.append(_run_arm(arm_cfg, layout, arm))
                log.info(
                    "%s %s on %s: stalls %s", layout, arm, where or LOCAL, report.runs[-1].stall_s
                )
    if json_path is not None:
        write_result(
            json_path,
            {
                "device": report.device,
                "run": report.run,
                **({"store": report.store} if report.store else {}),
                "rows": report.rows,
                "runs": [asdict(r) for r in report.runs],
            },
        )
    return report
