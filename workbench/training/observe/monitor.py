"""Device monitoring: what each rank's GPU (or CPU process) is doing, sampled in a background
thread.

Every rank runs one `DeviceMonitor`. Its daemon thread samples every `monitor_interval_s`:

- on a GPU, through NVML (the `pynvml` module of the optional `nvidia-ml-py` package) for this
  rank's device: utilisation %, memory used (the whole device's, as nvidia-smi shows it), power in
  W, temperature in C; without pynvml, only the memory PyTorch's allocator reserves (one warning per
  process);
- always, with psutil: this process's CPU % (100 per busy core, so it can exceed 100) and resident
  memory.

The samples go into lock-protected accumulators; the training thread takes one window's aggregate at
each log step and sends it with the metrics all-gather it does anyway (metrics_log.py). The
thread never calls a collective or touches CUDA streams, and holds its lock only to add numbers: the
step never waits on it. A rank whose GPU stays under `idle_util_pct` for `idle_after_s` gets one
'gpu_idle' event per episode (idle GPUs are the first waste the cost guides name); it re-arms once
the GPU is busy again. The samplers themselves (NVML, PyTorch's allocator, psutil) are in
device_samplers.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil

from workbench.training.observe.device_samplers import (
    NAN,
    NvmlSampler,
    ProcessSampler,
    TorchMemorySampler,
    load_nvml,
)

if TYPE_CHECKING:
    import torch

    from workbench.config import RunConfig

log = logging.getLogger("workbench")

FIELDS = ("gpu_util_pct", "gpu_mem_used_bytes", "gpu_power_w", "gpu_temp_c", "cpu_pct", "rss_bytes")
"""What a sample holds, in the order the metrics all-gather carries it; a row has '<field>_per_rank'
lists."""
PEAKS = ("gpu_mem_used_bytes", "gpu_temp_c", "rss_bytes")
"""Levels, reported as the window's maximum (what came close to a limit); the rates are the window's
mean."""
BYTES = ("gpu_mem_used_bytes", "rss_bytes")
IDLE_ADVICE = (
    "the GPU waits on something else: data loading (raise num_workers, pre-tokenise), CPU-side "
    "work in the step, evaluation or checkpoints, or a slower peer rank; an idle GPU is paid for "
    "all the same"
)

_missing_warned = False


class _Window:
    """Sums, counts and maxima of one logging window."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(FIELDS, 0.0)
        self.counts = dict.fromkeys(FIELDS, 0)
        self.peaks = dict.fromkeys(FIELDS, -math.inf)

    def add(self, sample: dict[str, float]) -> None:
        for name, value in sample.items():
            if not math.isnan(value):
                self.sums[name] += value
                self.counts[name] += 1
                self.peaks[name] = max(self.peaks[name], value)

    def aggregate(self) -> dict[str, float]:
        return {
            name: (self.peaks[name] if name in PEAKS else self.sums[name] / self.counts[name])
            if self.counts[name]
            else NAN
            for name in FIELDS
        }


class DeviceMonitor:
    """Samples one rank's device in a daemon thread; `take_window()` hands the training thread its
    aggregates.

    gpu_index: the CUDA device index of this rank's GPU, or None for a CPU rank (process CPU % and
    RSS only). nvml: the pynvml module to use (tests pass a fake); by default imported when the
    thread starts. on_idle: called from the thread with the 'gpu_idle' event's fields when a GPU
    stays under idle_util_pct for idle_after_s (0: never). CPU ranks get no idle warning: a
    process's CPU % says how busy it is, not whether an accelerator someone pays for stands still; a
    CPU rank waiting on a peer is not that waste. step_of: where the rank is, named in the event.
    """

    def __init__(
        self,
        interval_s: float,
        gpu_index: int | None = None,
        *,
        rank: int = 0,
        idle_util_pct: float = 10.0,
        idle_after_s: float = 300.0,
        on_idle: Callable[[dict[str, Any]], None] | None = None,
        nvml: Any = None,
        step_of: Callable[[], int] | None = None,
    ) -> None:
        self.interval_s, self.gpu_index, self.rank = interval_s, gpu_index, rank
        self.idle_util_pct, self.idle_after_s = idle_util_pct, idle_after_s
        self.on_idle, self.nvml, self.step_of = on_idle, nvml, step_of
        self.source = "cpu" if gpu_index is None else "pending"
        """What the GPU numbers come from once the thread runs: 'nvml', 'torch' (pynvml missing) or
        'cpu'."""
        self.idle_events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._window, self._last = _Window(), dict.fromkeys(FIELDS, NAN)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle_since: float | None = None
        # the episode's mean, without keeping every sample
        self._idle_sum, self._idle_samples = 0.0, 0
        self._warned = False
        self._cpu_mark: tuple[float, float] | None = None
        """(wall clock, this process's CPU time) where the current window began (take_window)."""

    # ---- the training thread's side --------------------------------------------------------------
    def start(self) -> DeviceMonitor:
        if self._thread is None:
            self._cpu_mark = (time.monotonic(), time.process_time())
            self._thread = threading.Thread(
                target=self._run, name=f"wb-monitor-{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (it closes NVML); safe to call twice, or without start()."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "rank %d: device monitor did not stop within %.0f s (a hung NVML call?)",
                    self.rank,
                    timeout,
                )

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_ready(self, timeout: float) -> bool:
        """Whether the thread has opened its samplers (or given up on NVML) within `timeout`
        seconds."""
        return self._ready.wait(timeout)

    def take_window(self) -> dict[str, float]:
        """The aggregates since the last call (NaN: not measured), and a fresh window. A window
        shorter than the interval has no sample of its own: it reports the latest one rather than a
        gap."""
        with self._lock:
            window, self._window = self._window, _Window()
            last = dict(self._last)
        values = window.aggregate()
        values = {
            name: last[name] if math.isnan(value) else value for name, value in values.items()
        }
        return {**values, **self._own_process(values)}

    def _own_process(self, values: dict[str, float]) -> dict[str, float]:
        """This process's CPU % over the window from its CPU time (all threads, as psutil counts
        it), and its RSS now if no sample has it yet. The sampler's first CPU reading only starts
        psutil's clock, and its second comes an interval later: a run whose steps are short logged
        tens of steps without CPU % (the monitor's figure started at step ~100). The CPU time
        gives the window's exact mean from the first logged step on."""
        now = (time.monotonic(), time.process_time())
        mark, self._cpu_mark = self._cpu_mark, now
        own: dict[str, float] = {}
        if mark is not None and now[0] - mark[0] > 1e-3:
            own["cpu_pct"] = 100.0 * (now[1] - mark[1]) / (now[0] - mark[0])
        if math.isnan(values["rss_bytes"]):  # the thread hasn't sampled yet
            own["rss_bytes"] = float(psutil.Process().memory_info().rss)
        return own

    def window_vector(self) -> list[float]:
        """take_window() in FIELDS order, for the metrics all-gather."""
        window = self.take_window()
        return [window[name] for name in FIELDS]

    # ---- the sampling thread ---------------------------------------------------------------------
    def _open(self) -> list[Any]:
        samplers: list[Any] = [ProcessSampler()]
        if self.gpu_index is None:
            return samplers
        nvml = self.nvml if self.nvml is not None else load_nvml()
        if nvml is None:
            _warn_missing_once()
        else:
            try:
                samplers.append(NvmlSampler(nvml, self.gpu_index))
                self.source = "nvml"
                return samplers
            except Exception as e:  # noqa: BLE001
                # no driver access, a MIG slice: monitor what we can
                log.warning(
                    "rank %d: NVML could not watch CUDA device %d (%s); GPU memory from PyTorch "
                    "only",
                    self.rank,
                    self.gpu_index,
                    e,
                )
        samplers.append(TorchMemorySampler(self.gpu_index))
        self.source = "torch"
        return samplers

    def _run(self) -> None:
        samplers: list[Any] = []
        failed = False
        try:
            samplers = self._open()
            self._ready.set()
            # a first sample at once: even a run's first window has its GPU memory and RSS
            while True:
                try:
                    self.sample_once(samplers)
                except Exception:  # noqa: BLE001
                    # monitoring must never end a run; say so once, keep trying
                    if not failed:
                        log.exception("rank %d: device monitor failed to sample", self.rank)
                    failed = True
                if self._stop.wait(self.interval_s):
                    break
        except Exception:  # noqa: BLE001
            log.exception("rank %d: device monitor could not start", self.rank)
        finally:
            self._ready.set()
            for sampler in samplers:
                sampler.close()

    def sample_once(self, samplers: list[Any]) -> dict[str, float]:
        sample: dict[str, float] = {}
        for sampler in samplers:
            sample.update(sampler.sample())
        with self._lock:
            self._window.add(sample)
            self._last.update({k: v for k, v in sample.items() if not math.isnan(v)})
        util = sample.get("gpu_util_pct", NAN)
        if not math.isnan(util):
            self._watch_idle(util, time.monotonic())
        return sample

    def _watch_idle(self, util: float, now: float) -> None:
        """One event per idle episode: it starts at the first sample under the threshold, fires once
        it has lasted idle_after_s, and re-arms at the first sample at or over the threshold."""
        if util >= self.idle_util_pct or not self.idle_after_s:
            self._idle_since, self._idle_sum, self._idle_samples, self._warned = None, 0.0, 0, False
            return
        if self._idle_since is None:
            self._idle_since = now
        self._idle_sum += util
        self._idle_samples += 1
        seconds = now - self._idle_since
        if self._warned or seconds < self.idle_after_s:
            return
        self._warned = True
        event = {
            "rank": self.rank,
            "util_pct": round(self._idle_sum / self._idle_samples, 1),
            "seconds": round(seconds, 1),
            "threshold_pct": self.idle_util_pct,
            "step": self.step_of() if self.step_of else None,
            "advice": IDLE_ADVICE,
        }
        self.idle_events.append(event)
        log.warning(
            "rank %d: GPU under %g%% utilisation for %.0f s (mean %.1f%%): %s",
            self.rank,
            self.idle_util_pct,
            seconds,
            event["util_pct"],
            IDLE_ADVICE,
        )
        if self.on_idle is not None:
            try:
                self.on_idle(event)
            except OSError as e:
                # a full disk must not stop the sampling (the warning is logged above)
                log.warning("rank %d: could not record the gpu_idle event: %s", self.rank, e)


def _warn_missing_once() -> None:
    global _missing_warned
    if not _missing_warned:
        _missing_warned = True
        log.warning(
            "device monitoring on a GPU needs nvidia-ml-py (pip install 'workbench[gpu]'); "
            "without it only the memory PyTorch reserves is recorded, no utilisation, power or "
            "temperature"
        )


def for_rank(
    cfg: RunConfig,
    device: torch.device,
    rank: int,
    event: Callable[..., None],
    step_of: Callable[[], int],
) -> DeviceMonitor | None:
    """The monitor a rank of `cfg` runs on `device` (None with monitor_interval_s=0); gpu_idle
    events go to `event` (RunDir.event: one O_APPEND write per line, so ranks and threads may share
    events.jsonl)."""
    if not cfg.monitor_interval_s:
        return None
    import torch

    gpu = None
    if device.type == "cuda":
        gpu = device.index if device.index is not None else torch.cuda.current_device()
    return DeviceMonitor(
        cfg.monitor_interval_s,
        gpu,
        rank=rank,
        idle_util_pct=cfg.idle_util_pct,
        idle_after_s=cfg.idle_after_s,
        on_idle=lambda fields: event("gpu_idle", **fields),
        step_of=step_of,
    )


def row_fields(gathered: Any) -> dict[str, list[float | int | None]]:
    """The metrics row's '<field>_per_rank' lists from the gathered (ranks x FIELDS) tensor; a field
    no rank measured is left out, a rank that didn't measure it is None."""
    out: dict[str, list[float | int | None]] = {}
    for i, name in enumerate(FIELDS):
        column = [float(v) for v in gathered[:, i].tolist()]
        if all(math.isnan(v) for v in column):
            continue
        out[f"{name}_per_rank"] = [
            None if math.isnan(v) else int(v) if name in BYTES else round(v, 1) for v in column
        ]
    return out
