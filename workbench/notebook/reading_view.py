"""The run as the latest `Reading` shows it: its status, rows and step, the session's average
pace, the progress line and the numbers table (loss, eval, throughput, memory, learning rate, the
device monitor, warnings, profile traces, the error or how the run ended).

`ReadingView` is the dashboard's read side, without widgets: `Dashboard` derives every number it
shows from it, and so do the views built on a dashboard (`LiveView`, the panel's run list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workbench.notebook.pace import progress_line, run_average, window_steps
from workbench.notebook.reading import Reading, fmt_num
from workbench.rundir import ENDED, MetricsRow, Status
from workbench.utils.units import fmt_bytes

if TYPE_CHECKING:
    from workbench.rundir import RunDir


class ReadingView:
    """What `reading` says about the run in `dir`; a subclass keeps `reading` up to date, and sets
    `_max_steps` (None: read from the run's config once it is written) and `show_error`."""

    reading: Reading
    dir: RunDir
    _max_steps: int | None
    show_error: bool

    @property
    def max_steps(self) -> int | None:
        if self._max_steps is None:
            try:
                cfg = self.dir.config()
            except (OSError, ValueError):
                return None  # half written, or not a RunConfig: ask again next poll
            if cfg is None:
                return None  # not written yet
            self._max_steps = cfg.max_steps
        return self._max_steps

    @property
    def rows(self) -> list[MetricsRow]:
        return self.reading.rows

    @property
    def summary(self) -> dict[str, Any]:
        return self.reading.summary

    @property
    def status(self) -> str:
        """The run's status; 'failed' once a run that says it runs has lost all its processes."""
        return str(self.reading.observed[0])

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def train_rows(self) -> list[MetricsRow]:
        return self.reading.train_rows

    @property
    def eval_rows(self) -> list[MetricsRow]:
        return self.reading.eval_rows

    @property
    def last_train_row(self) -> MetricsRow | None:
        train = self.train_rows
        return train[-1] if train else None

    @property
    def step(self) -> int:
        """The latest step the run directory reports."""
        last = self.last_train_row
        step = int(self.summary.get("steps") or 0) if self.ended else 0
        return max(step, last.step if last else 0)

    @property
    def run_average(self) -> float | None:
        """samples/s over this session of the run, as summary.json's samples_per_s defines it."""
        return run_average(self.reading, self.ended)

    def progress_line(self) -> str:
        return progress_line(
            self.reading, self.max_steps, self.step, self.status if self.ended else None
        )

    def stat_items(self, show_error: bool | None = None) -> list[tuple[str, str]]:
        """The numbers as (label, value): loss, eval, throughput (window and run average), memory,
        lr, the device monitor's latest window, warnings (idle GPUs), profile traces, error."""
        last, evals = self.last_train_row, self.eval_rows
        items: list[tuple[str, str]] = [("loss", fmt_num(last.loss if last else None))]
        if evals:
            last_eval = evals[-1]
            items.append(("eval loss", f"{fmt_num(last_eval.eval_loss)} (step {last_eval.step})"))
            items += [
                (key.replace("_", " "), fmt_num(value)) for key, value in last_eval.eval.items()
            ]
        items += throughput_items(self.reading, self.run_average)
        per_rank = (last.peak_memory_bytes_per_rank if last else None) or []
        if per_rank:
            items.append(
                (
                    "peak memory",
                    ", ".join(f"rank {i}: {fmt_bytes(b)}" for i, b in enumerate(per_rank)),
                )
            )
        elif last and last.peak_memory_bytes is not None:
            items.append(("peak memory", f"{fmt_bytes(last.peak_memory_bytes)} (max over ranks)"))
        items.append(("learning rate", fmt_num(last.lr if last else None, ".3g")))
        items += monitor_items(last)
        items += [("compile", self.reading.compile)] * bool(self.reading.compile)
        items += [("warning", line) for line in self.reading.warnings]
        if self.reading.profiles:
            items.append(
                (
                    "profile",
                    ", ".join(self.reading.profiles) + " (Chrome traces: open in ui.perfetto.dev "
                    "or chrome://tracing)",
                )
            )
        if self.show_error if show_error is None else show_error:
            items += self._ending_items()
        return items

    def _ending_items(self) -> list[tuple[str, str]]:
        if self.status == Status.FAILED:
            error = self.summary.get("error") or {
                "type": "Lost",
                "message": self.reading.observed[1],
            }
            where = f"rank {error['rank']}" if error.get("rank") is not None else "the launcher"
            return [("error", f"{where}: {error.get('type', 'Error')}: {error.get('message', '')}")]
        if (self.summary.get("ending") or {}).get("message"):
            return [("ending", self.summary["ending"]["message"])]
        return []


def throughput_items(reading: Reading, average: float | None) -> list[tuple[str, str]]:
    """The latest window's samples/s (tokens/s) and step time, labelled with their window, the run's
    `average` samples/s beside them, as (label, value)."""
    last = reading.train_rows[-1] if reading.train_rows else None
    if last is None:
        return [("samples/s", "–")]
    n = window_steps(reading)
    window = f"last {n} step{'s' if n != 1 else ''}"
    window_rate = last.samples_per_s
    items = [
        (
            "samples/s",
            f"{fmt_num(window_rate, ',.0f')} ({window}) · {fmt_num(average, ',.0f')} (run average)",
        )
    ]
    if last.tokens_per_s is not None:
        tokens_avg = (
            average * last.tokens_per_s / window_rate
            if average is not None and window_rate
            else None
        )
        items.append(
            (
                "tokens/s",
                (
                    f"{fmt_num(last.tokens_per_s, ',.0f')} ({window}) · "
                    f"{fmt_num(tokens_avg, ',.0f')} (run average)"
                ),
            )
        )
    if last.step_time_s is not None:
        items.append(("step time", f"{1000 * last.step_time_s:.1f} ms ({window})"))
    return items


def monitor_items(row: MetricsRow | None) -> list[tuple[str, str]]:
    """The device monitor's latest window per rank, for the numbers table (absent: no line)."""
    if row is None:
        return []

    def per_rank(values: list[Any] | None, fmt: Callable[[Any], str]) -> str | None:
        if not values or all(v is None for v in values):
            return None
        return ", ".join(f"rank {i}: {'–' if v is None else fmt(v)}" for i, v in enumerate(values))

    lines = [
        ("GPU utilisation", per_rank(row.gpu_util_pct_per_rank, lambda v: f"{v:.0f}%")),
        ("GPU memory used", per_rank(row.gpu_mem_used_bytes_per_rank, fmt_bytes)),
        ("GPU power", per_rank(row.gpu_power_w_per_rank, lambda v: f"{v:.0f} W")),
        ("GPU temperature", per_rank(row.gpu_temp_c_per_rank, lambda v: f"{v:.0f} °C")),
        ("process CPU", per_rank(row.cpu_pct_per_rank, lambda v: f"{v:.0f}%")),
        ("process RSS", per_rank(row.rss_bytes_per_rank, fmt_bytes)),
    ]
    return [(label, text) for label, text in lines if text is not None]
