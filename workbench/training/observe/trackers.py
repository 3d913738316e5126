"""Experiment trackers on the rank side: accelerate's TensorBoard and MLflow integrations, fed the
config as hyperparameters and every metrics row that goes to metrics.jsonl. accelerate runs its
trackers on the main process only, so rank 0 writes them, into the run directory (see
workbench/config/trackers.py for the layout).

TensorBoard's rows are written by a thread of rank 0's own: SummaryWriter.add_scalar costs ~0.13 ms
a value (a row of two ranks holds ~45), and accelerate flushes after every row; in the training
thread that held the logging step up 5-13 ms on a 2-core box, and every other rank with it at the
next collective. MLflow stays in the training thread: its active run is thread-local."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any

from workbench.config.trackers import MLFLOW_ENV, mlflow_uri
from workbench.rundir.metrics_row import VERSION_KEY, MetricsRow

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.rundir import RunDir

log = logging.getLogger("workbench")

HParam = str | int | float | bool


def hyperparameters(cfg: RunConfig, **derived: Any) -> dict[str, HParam]:
    """The config as flat name -> value pairs TensorBoard's hparams and MLflow's params accept:
    task_options spread into 'task_options.<name>', and what they can't hold (None, lists) written
    as JSON text."""
    flat: dict[str, HParam] = {}
    for name, value in {**cfg.to_dict(), **derived}.items():
        if name == "task_options":
            flat.update({f"task_options.{k}": _hparam(v) for k, v in sorted(value.items())})
        else:
            flat[name] = _hparam(value)
    return flat


def _hparam(value: Any) -> HParam:
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, default=str)


def scalars(row: dict[str, Any]) -> dict[str, float | int]:
    """A metrics row's numbers, by name: per-rank lists become '<name>/rank_<i>'. The step is the
    x axis, the schema version no metric, and what isn't a number (the verdicts) stays in
    metrics.jsonl."""
    out: dict[str, float | int] = {}
    for name, value in row.items():
        if name in ("step", VERSION_KEY) or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            out.update({f"{name}/rank_{i}": v for i, v in enumerate(value)})
    return out


class RunTrackers:
    """The run's trackers, started once the config is final (micro_batch_size='auto' chosen), fed
    every metrics row, and finished however the run ends."""

    def __init__(self, accelerator: Accelerator, run: RunDir) -> None:
        self.accelerator, self.run = accelerator, run
        self.active = False
        self._rows: queue.Queue[tuple[Any, dict[str, Any], int] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def names(self) -> list[str]:
        return [str(name) for name in self.accelerator.log_with]

    def start(self, cfg: RunConfig, **derived: Any) -> None:
        if not self.names or not self.accelerator.is_main_process:
            return
        if "mlflow" in self.names:
            import mlflow

            # This rank's process only: the caller's environment and MLflow settings stay as they
            # are.
            os.environ.update(MLFLOW_ENV)
            mlflow.set_tracking_uri(mlflow_uri(self.run.path))
        self.accelerator.init_trackers(
            self.run.name,
            config=hyperparameters(cfg, **derived),
            init_kwargs={"mlflow": {"run_name": self.run.name}},
        )
        self.active = True
        if any(t.name == "tensorboard" for t in self.accelerator.trackers):
            self._writer = threading.Thread(
                target=self._write_rows, name="wb-tensorboard", daemon=True
            )
            self._writer.start()
        log.info("trackers: %s, in %s", ", ".join(self.names), self.run.path)

    def _write_rows(self) -> None:
        while (item := self._rows.get()) is not None:
            tracker, values, step = item
            try:
                tracker.log(values, step=step)
            except BaseException as e:  # noqa: BLE001
                # raised in the training thread, at its next row
                self._error = e
                return

    def log(self, row: MetricsRow) -> None:
        if not self.active:
            return
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing metrics to TensorBoard failed: {error}") from error
        values, step = scalars(row.to_dict()), row.step
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard" and self._writer is not None:
                self._rows.put((tracker, values, step))
            else:
                tracker.log(values, step=step)

    def end(self) -> None:
        """Flush and close each tracker. Not accelerator.end_training(): that also destroys the
        process group, and this runs on failure paths too, where other ranks may still be in a
        collective."""
        if not self.active:
            return
        self.active = False
        if self._writer is not None:  # the rows still queued go in first
            self._rows.put(None)
            self._writer.join(timeout=60)
            if self._error is not None:
                log.warning("could not write every metrics row to TensorBoard: %s", self._error)
        for tracker in self.accelerator.trackers:
            try:
                tracker.finish()
            except Exception as e:  # noqa: BLE001
                # a tracker that can't close must not hide the run's own error
                log.warning("could not close the %s tracker: %s", tracker.name, e)
