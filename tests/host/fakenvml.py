"""A fake `pynvml`, put in sys.modules where the real module would be (the outermost
seam: no NVIDIA driver or libnvidia-ml runs on these machines).

It stands for NVML as the nvidia-ml-py bindings expose it, per NVML's API
reference: `nvmlInit`/`nvmlShutdown`; per device index a handle with its PCI bus
id (`00000000:0A:00.0`, upper case, eight-digit domain), name, UUID and memory;
`nvmlDeviceGetComputeRunningProcesses` and `...GraphicsRunningProcesses` listing
the processes with a context on *that* GPU (pid and used memory, None where the
driver does not say); errors as `NVMLError`.  Only the GPUs bound to `nvidia` are
listed (NVML cannot see one on vfio-pci), which each test arranges by the GPUs it
passes.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field


@dataclass
class FakeGpu:
    bus_id: str  # NVML's spelling: "00000000:0A:00.0"
    name: str = "NVIDIA GeForce RTX 4090"
    uuid: str = "GPU-1234"
    memory: int = 24 * 2**30
    compute: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)


def fake_pynvml(
    calls: list[str], gpus: list[FakeGpu] | None = None, fail_init: bool = False
) -> types.ModuleType:
    """The module; `calls` records each NVML call by a short name."""
    module = types.ModuleType("pynvml")
    listed = gpus if gpus is not None else [FakeGpu("00000000:0A:00.0")]

    class NVMLError(Exception):
        pass

    def call(name, value=None):
        def answer(*args):
            calls.append(name)
            return value(*args) if callable(value) else value

        return answer

    def init():
        calls.append("init")
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    def processes(kind):
        return lambda handle: [
            types.SimpleNamespace(pid=pid, usedGpuMemory=used)
            for pid, used in getattr(handle, kind)
        ]

    module.NVMLError = NVMLError
    module.nvmlInit = init
    module.nvmlShutdown = call("shutdown")
    module.nvmlDeviceGetCount = call("count", lambda: len(listed))
    module.nvmlDeviceGetHandleByIndex = call("handle", lambda index: listed[index])
    module.nvmlDeviceGetPciInfo = call(
        "pci", lambda handle: types.SimpleNamespace(busId=handle.bus_id.encode())
    )
    module.nvmlDeviceGetName = call("name", lambda handle: handle.name)
    module.nvmlDeviceGetUUID = call("uuid", lambda handle: handle.uuid)
    module.nvmlDeviceGetMemoryInfo = call(
        "memory", lambda handle: types.SimpleNamespace(total=handle.memory)
    )
    module.nvmlDeviceGetComputeRunningProcesses = call("compute", processes("compute"))
    module.nvmlDeviceGetGraphicsRunningProcesses = call("graphics", processes("graphics"))
    return module
