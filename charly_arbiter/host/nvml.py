"""NVIDIA GPUs through NVML (`pynvml`, from the nvidia-ml-py distribution).

Imported only when asked: most commands never need it, and an initialized
NVML holds /dev/nvidia* open itself, so the host closes it before any driver
switch.  When the module or libnvidia-ml is absent, `error` says why and the
caller falls back to sysfs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NvmlProcess:
    pid: int
    used_memory: int | None  # bytes; None where the driver does not say


@dataclass(frozen=True)
class NvmlGpu:
    address: str
    name: str
    uuid: str
    memory_total: int
    processes: tuple[NvmlProcess, ...]


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's `00000000:0A:00.0` -> sysfs's `0000:0a:00.0`."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    domain, _, rest = text.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Nvml:
    """An NVML session opened on first use and closed by `close`."""

    def __init__(self) -> None:
        self._lib: ModuleType | None = None
        self.error: str | None = None

    @property
    def is_open(self) -> bool:
        return self._lib is not None

    def open(self) -> bool:
        if self._lib is not None:
            return True
        try:
            import pynvml
        except ImportError:
            self.error = "pynvml (nvidia-ml-py) is not installed"
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            self.error = f"NVML is not usable: {error}"
            return False
        self._lib = pynvml
        self.error = None
        return True

    def gpus(self) -> dict[str, NvmlGpu]:
        """address -> what NVML says about the GPU there; {} when NVML is unusable."""
        if not self.open() or self._lib is None:
            return {}
        nvml: Any = self._lib
        found: dict[str, NvmlGpu] = {}
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                address = normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
                processes = [
                    *nvml.nvmlDeviceGetComputeRunningProcesses(handle),
                    *nvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
                ]
                found[address] = NvmlGpu(
                    address=address,
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    memory_total=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                    processes=tuple(
                        NvmlProcess(int(p.pid), _memory(p.usedGpuMemory)) for p in processes
                    ),
                )
        except nvml.NVMLError as error:
            self.error = f"NVML failed: {error}"
            log.warning("%s", self.error)
        return found

    def close(self) -> None:
        """Shut NVML down, so that it no longer holds /dev/nvidia* open."""
        if self._lib is None:
            return
        nvml: Any = self._lib
        self._lib = None
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as error:
            log.warning("nvmlShutdown failed: %s", error)


def _memory(value: Any) -> int | None:
    # NVML reports "not available" as None or as a huge sentinel value.
    if value is None or not isinstance(value, int) or value >= 2**63:
        return None
    return value
