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

from charly_arbiter.core.host import MigChange, MigInstance, MigState
from charly_arbiter.errors import MigFailed, MigInvalid

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

    # -- MIG -----------------------------------------------------------------------------

    def _handle(self, address: str) -> Any:
        """NVML's handle of the GPU at `address` (None: NVML does not list it)."""
        if not self.open() or self._lib is None:
            return None
        nvml: Any = self._lib
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId) == address:
                return handle
        return None

    def mig(self, address: str) -> MigState | None:
        """The GPU's MIG mode and instances; None when NVML cannot say or the GPU has no
        MIG (`error` says which)."""
        try:
            handle = self._handle(address)
            if handle is None:
                self.error = self.error or f"NVML does not list {address}"
                return None
            nvml: Any = self._lib
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
            instances = []
            if current == nvml.NVML_DEVICE_MIG_ENABLE:
                for index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                    try:
                        mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
                    except nvml.NVMLError:
                        continue  # no MIG device at this index
                    instances.append(
                        MigInstance(
                            index=index,
                            gpu_instance=int(nvml.nvmlDeviceGetGpuInstanceId(mig)),
                            compute_instance=int(nvml.nvmlDeviceGetComputeInstanceId(mig)),
                            uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
                            profile=_profile(_text(nvml.nvmlDeviceGetName(mig))),
                        )
                    )
            return MigState(
                enabled=current == nvml.NVML_DEVICE_MIG_ENABLE,
                pending=pending != current,
                index=int(nvml.nvmlDeviceGetIndex(handle)),
                instances=tuple(instances),
            )
        except Exception as error:  # NVMLError (NOT_SUPPORTED: no MIG on this GPU)
            if self._lib is None or not isinstance(error, self._lib.NVMLError):
                raise
            self.error = f"NVML: {error}"
            return None

    def set_mig(self, address: str, change: MigChange) -> MigState:
        """Turn MIG on or off (nvmlDeviceSetMigMode), or lay the GPU out anew: every
        compute and GPU instance destroyed, then a GPU instance per profile, each with
        the compute instance that takes all of it (what `nvidia-smi mig -cgi P -C`
        does).  NVML refuses either while a process uses the GPU."""
        state = self.mig(address)
        if state is None:
            raise MigInvalid(address, f"it has no MIG ({self.error})")
        nvml: Any = self._lib
        handle = self._handle(address)
        try:
            if change.layout is None:
                wanted = (
                    nvml.NVML_DEVICE_MIG_ENABLE if change.enabled else nvml.NVML_DEVICE_MIG_DISABLE
                )
                nvml.nvmlDeviceSetMigMode(handle, wanted)
            else:
                if not state.enabled:
                    raise MigInvalid(address, "MIG mode is off: turn it on first")
                self._destroy_instances(handle, state)
                for profile in change.layout:
                    self._create_instance(handle, address, profile)
        except nvml.NVMLError as error:
            raise MigFailed(
                address,
                str(change),
                str(error),
                hint="every process must have let go of the GPU (nvidia-smi shows them)",
            ) from None
        after = self.mig(address)
        if after is None:
            raise MigFailed(address, str(change), f"NVML cannot read it back: {self.error}")
        if change.layout is None and after.pending:
            raise MigFailed(
                address,
                str(change),
                "the mode is pending: the GPU takes it at its next reset",
                hint=f"reset it (`nvidia-smi -r -i {address}`) or reboot",
            )
        return after

    def _destroy_instances(self, handle: Any, state: MigState) -> None:
        nvml: Any = self._lib
        for instance in state.instances:
            gpu_instance = nvml.nvmlDeviceGetGpuInstanceById(handle, instance.gpu_instance)
            compute = nvml.nvmlGpuInstanceGetComputeInstanceById(
                gpu_instance, instance.compute_instance
            )
            nvml.nvmlComputeInstanceDestroy(compute)
        for gpu_instance_id in sorted({i.gpu_instance for i in state.instances}):
            nvml.nvmlGpuInstanceDestroy(nvml.nvmlDeviceGetGpuInstanceById(handle, gpu_instance_id))

    def _create_instance(self, handle: Any, address: str, profile: str) -> None:
        nvml: Any = self._lib
        info = None
        for number in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                candidate = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, number)
            except nvml.NVMLError:
                continue  # not a profile of this GPU
            if _profile(_text(candidate.name)) == profile:
                info = candidate
                break
        if info is None:
            raise MigInvalid(address, f"it has no MIG profile {profile}")
        gpu_instance = nvml.nvmlDeviceCreateGpuInstance(handle, info.id)
        for number in range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                compute = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gpu_instance, number, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except nvml.NVMLError:
                continue
            if compute.sliceCount == info.sliceCount:
                nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, compute.id)
                return
        raise MigFailed(address, f"layout {profile}", "no compute instance profile takes all of it")

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


def _profile(name: str) -> str:
    """A MIG profile from NVML's names: `NVIDIA H100 80GB HBM3 MIG 1g.10gb` (a MIG
    device) or `MIG 1g.10gb` (a GPU instance profile) -> `1g.10gb`."""
    return name.rpartition("MIG ")[2].strip() if "MIG " in name else name.strip()


def _memory(value: Any) -> int | None:
    # NVML reports "not available" as None or as a huge sentinel value.
    if value is None or not isinstance(value, int) or value >= 2**63:
        return None
    return value
