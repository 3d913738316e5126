"""Device monitoring: what each rank's GPU (or CPU process) is doing, sampled in a background
thread.

Every rank runs one `DeviceMonitor`. Its daemon thread samples every `monitor_interval_s`:

- on a GPU, through NVML (the `pynvml` module of the optional `nvidia-ml-py` package) for this
  rank's device:
  utilisation %, memory used (the whole device's, as nvidia-smi shows it), power in W, temperature
  in C; without pynvml, only the memory PyTorch's allocator reserves (one warning per process);
- always, with psutil: this process's CPU % (100 per busy core, so it can exceed 100) and resident
  memory.

The samples go into lock-protected accumulators; the training thread takes one window's aggregate at
each log step and sends it with the metrics all-gather it does anyway (training/logger.py). The
thread never calls a collective or touches CUDA streams, and holds its lock only to add numbers: the
step never waits on it. A rank whose GPU stays under `idle_util_pct` for `idle_after_s` gets one
'gpu_idle' event per episode (idle GPUs are the first waste the cost guides name); it re-arms once
the GPU is busy again.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil

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
NAN = float("nan")
IDLE_ADVICE = (
    "the GPU waits on something else: data loading (raise num_workers, pre-tokenise), CPU-side "
    "work in the step, evaluation or checkpoints, or a slower peer rank; an idle GPU is paid for "
    "all the same"
)

_missing_warned = False


def load_nvml() -> Any:
    """The pynvml module, or None when nvidia-ml-py isn't installed (imported here only: an optional
    extra)."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def nvml_target(device_index: int, visible: str | None) -> int | str:
    """The GPU that CUDA calls `device_index`, as NVML knows it: an NVML index, or a UUID (prefix).

    NVML numbers every GPU of the machine; CUDA only those CUDA_VISIBLE_DEVICES lists, in its order,
    by index or by UUID. (CUDA's default order is fastest-first, NVML's is PCI: on a mixed machine
    they can differ; the UUID torch reports is tried first for that reason, see `NvmlSampler`.)
    """
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if visible is None or not entries:
        return device_index
    if device_index >= len(entries):
        raise LookupError(
            f"CUDA device {device_index} is not among CUDA_VISIBLE_DEVICES={visible!r}"
        )
    entry = entries[device_index]
    return int(entry) if entry.isdigit() else entry


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSampler:
    """One GPU through NVML. Readings a GPU doesn't support (power on some boards) are NaN, not
    errors."""

    def __init__(self, nvml: Any, device_index: int) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        try:
            self.handle = self._handle(device_index)
        except Exception:
            nvml.nvmlShutdown()
            raise

    def _handle(self, device_index: int) -> Any:
        nvml = self.nvml
        uuid = _torch_uuid(device_index)
        if uuid:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(uuid)
            except nvml.NVMLError:
                pass  # a MIG slice or an old driver: fall back to CUDA_VISIBLE_DEVICES
        target = nvml_target(device_index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if isinstance(target, int):
            return nvml.nvmlDeviceGetHandleByIndex(target)
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            if _text(nvml.nvmlDeviceGetUUID(handle)).startswith(
                target
            ):  # CUDA accepts unique prefixes too
                return handle
        raise LookupError(
            f"no GPU with UUID {target!r} (CUDA_VISIBLE_DEVICES) among NVML's devices"
        )

    def _read(self, call: Callable[[], float]) -> float:
        try:
            return float(call())
        except self.nvml.NVMLError:
            return NAN

    def sample(self) -> dict[str, float]:
        nvml, h = self.nvml, self.handle
        return {
            "gpu_util_pct": self._read(lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            "gpu_mem_used_bytes": self._read(lambda: nvml.nvmlDeviceGetMemoryInfo(h).used),
            "gpu_power_w": self._read(
                lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            ),  # milliwatts
            "gpu_temp_c": self._read(
                lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
            ),
        }

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def _torch_uuid(device_index: int) -> str | None:
    """'GPU-<uuid>' of CUDA device `device_index` as torch sees it (None without CUDA or an old
    torch)."""
    import torch

    if not torch.cuda.is_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    return f"GPU-{uuid}" if uuid else None


class TorchMemorySampler:
    """Without pynvml: the memory PyTorch's allocator reserves on the device (no utilisation, power
    or heat)."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index

    def sample(self) -> dict[str, float]:
        import torch

        # Allocator bookkeeping only: no CUDA call, nothing that could wait on the training stream.
        return {"gpu_mem_used_bytes": float(torch.cuda.memory_reserved(self.device_index))}

    def close(self) -> None:
        pass


class ProcessSampler:
    """This process: CPU % since the previous sample (all threads; > 100 on several cores) and
    RSS."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.first = True

    def sample(self) -> dict[str, float]:
        cpu = self.process.cpu_percent(None)
        first, self.first = (
            self.first,
            False,
        )  # the first call only starts psutil's clock: no CPU % yet
        return {
            "cpu_pct": NAN if first else cpu,
            "rss_bytes": float(self.process.memory_info().rss),
        }

    def close(self) -> None:
        pass


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
        self._idle_sum, self._idle_samples = (
            0.0,
            0,
        )  # the episode's mean, without keeping every sample
        self._warned = False

    # ---- the training thread's side --------------------------------------------------------------
    def start(self) -> DeviceMonitor:
        if self._thread is None:
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
        return {name: last[name] if math.isnan(value) else value for name, value in values.items()}

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
            while (
                True
            ):  # a first sample at once: even a run's first window has its GPU memory and RSS
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
            except (
                OSError
            ) as e:  # a full disk must not stop the sampling (the warning is logged above)
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
