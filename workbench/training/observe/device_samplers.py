"""What a device monitor samples, one sampler per source: `NvmlSampler` reads one GPU through NVML
(utilisation, memory used on the whole device, power, temperature), `TorchMemorySampler` only the
memory PyTorch's allocator reserves (when pynvml is missing), `ProcessSampler` this process's CPU %
and RSS through psutil. Each has `sample()` (a dict of monitor.FIELDS entries, NaN where a reading
isn't supported) and `close()`; monitor.py's `DeviceMonitor` runs them in its thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import psutil

NAN = float("nan")


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
            # CUDA accepts unique prefixes too
            if _text(nvml.nvmlDeviceGetUUID(handle)).startswith(target):
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
            # NVML reports milliwatts
            "gpu_power_w": self._read(lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
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
        # the first call only starts psutil's clock: no CPU % yet
        first, self.first = self.first, False
        return {
            "cpu_pct": NAN if first else cpu,
            "rss_bytes": float(self.process.memory_info().rss),
        }

    def close(self) -> None:
        pass
