"""A stand-in for the pynvml module (nvidia-ml-py) with scriptable readings, so the GPU monitoring path runs on CPU.

It implements the calls workbench.training.observe.monitor makes, with pynvml's names, argument orders and units (memory in
bytes, power in milliwatts, temperature in C), and records the calls so tests can check initialisation,
the device chosen and shutdown.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    """pynvml raises NVMLError (subclassed per return code) for every failing call."""


class NVMLError_NotSupported(NVMLError):
    pass


@dataclass
class FakeGpu:
    """One GPU's scripted readings; change them while a monitor runs (reads and writes are under a lock)."""

    uuid: str
    util: float = 90.0
    mem_used: int = 4 * 2**30
    mem_total: int = 80 * 2**30
    power_mw: int | None = 250_000  # None: power readings not supported on this board
    temp_c: int = 60


@dataclass
class FakeNvml:
    """Pass an instance where workbench.training.observe.monitor expects the pynvml module."""

    gpus: list[FakeGpu] = field(
        default_factory=lambda: [FakeGpu(f"GPU-0000000{i}-fake") for i in range(4)]
    )
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    initialised: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVMLError = NVMLError

    def set(self, index: int, **readings: Any) -> None:
        with self.lock:
            for name, value in readings.items():
                setattr(self.gpus[index], name, value)

    def _gpu(self, handle: Any) -> FakeGpu:
        if self.initialised <= 0:
            raise NVMLError("Uninitialized")
        return self.gpus[handle.index]

    def _log(self, *call: Any) -> None:
        with self.lock:
            self.calls.append(call)

    def nvmlInit(self) -> None:
        self._log("nvmlInit")
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._log("nvmlShutdown")
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._log("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return SimpleNamespace(index=index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return SimpleNamespace(index=i)
        raise NVMLError("Not Found")

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        with self.lock:
            return SimpleNamespace(gpu=int(self._gpu(handle).util), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        with self.lock:
            gpu = self._gpu(handle)
            return SimpleNamespace(
                total=gpu.mem_total, used=gpu.mem_used, free=gpu.mem_total - gpu.mem_used
            )

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        with self.lock:
            power = self._gpu(handle).power_mw
        if power is None:
            raise NVMLError_NotSupported("Not Supported")
        return power

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError("Invalid Argument")
        with self.lock:
            return self._gpu(handle).temp_c
