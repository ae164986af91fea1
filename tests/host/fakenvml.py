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

MIG (`FakeMig`), per NVML's "Multi Instance GPU Management" API and NVIDIA's MIG
user guide, with the functions and constants nvidia-ml-py names: the mode, current
and pending (`nvmlDeviceGetMigMode`, `...SetMigMode`, refused with IN_USE while a
process has a context on the GPU, taking effect at once unless the GPU needs a
reset); GPU instance profiles by number (`nvmlDeviceGetGpuInstanceProfileInfo`,
whose v2 info names the profile `MIG 1g.10gb`), GPU instances made and destroyed
within the GPU's 7 compute slices, a compute instance in each; and the MIG devices
(`nvmlDeviceGetMigDeviceHandleByIndex`, NOT_FOUND where there is none) with their
GPU and compute instance ids, `MIG-` UUIDs and names.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field


@dataclass
class FakeMig:
    """A MIG-capable GPU's side: its profiles (profile number -> name and slices, as an
    H100 80GB has them), its mode, and its GPU instances (id -> profile number and its
    compute instance ids)."""

    profiles: dict[int, tuple[str, int]] = field(
        default_factory=lambda: {
            0: ("1g.10gb", 1),
            1: ("2g.20gb", 2),
            2: ("3g.40gb", 3),
            3: ("4g.40gb", 4),
            4: ("7g.80gb", 7),
        }
    )
    current: int = 0
    pending: int = 0
    reset_needed: bool = False  # a mode change waits for a GPU reset (as on A100 at times)
    instances: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


@dataclass
class FakeGpu:
    bus_id: str  # NVML's spelling: "00000000:0A:00.0"
    name: str = "NVIDIA GeForce RTX 4090"
    uuid: str = "GPU-1234"
    memory: int = 24 * 2**30
    compute: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    mig: FakeMig | None = None  # None: no MIG (NOT_SUPPORTED)


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
    _add_mig(module, listed, NVMLError, call)
    return module


def _add_mig(module, listed, NVMLError, call):
    """The MIG part of the fake module (see the module's docstring)."""
    module.NVML_DEVICE_MIG_DISABLE, module.NVML_DEVICE_MIG_ENABLE = 0, 1
    module.NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
    module.NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
    module.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0

    def mig_of(handle):
        if handle.mig is None:
            raise NVMLError("Not Supported")
        return handle.mig

    def devices(handle):
        """The MIG devices, in the order their compute instances were made."""
        mig = mig_of(handle)
        return [
            types.SimpleNamespace(gpu=handle, gi=gi, ci=ci, profile=profile)
            for gi, (profile, cis) in sorted(mig.instances.items())
            for ci in cis
        ]

    def set_mode(handle, mode):
        mig = mig_of(handle)
        if handle.compute or handle.graphics:
            raise NVMLError("In use by another client")
        mig.pending = mode
        if not mig.reset_needed:
            mig.current = mode
            mig.instances.clear()
        return 0

    def mig_device(handle, index):
        found = devices(handle)
        if index >= len(found):
            raise NVMLError("Not Found")
        return found[index]

    def profile_info(handle, number, version=2):
        mig = mig_of(handle)
        if number not in mig.profiles:
            raise NVMLError("Not Supported")
        name, slices = mig.profiles[number]
        return types.SimpleNamespace(id=number, sliceCount=slices, name=f"MIG {name}".encode())

    def create_gi(handle, profile_id):
        mig = mig_of(handle)
        if mig.current != 1:
            raise NVMLError("Not Supported")
        used = sum(mig.profiles[p][1] for p, _ in mig.instances.values())
        if used + mig.profiles[profile_id][1] > 7:
            raise NVMLError("Insufficient Resources")
        gi = max(mig.instances, default=0) + 1
        mig.instances[gi] = (profile_id, [])
        return types.SimpleNamespace(gpu=handle, gi=gi)

    def gi_by_id(handle, gi):
        if gi not in mig_of(handle).instances:
            raise NVMLError("Not Found")
        return types.SimpleNamespace(gpu=handle, gi=gi)

    def ci_profile(gpu_instance, number, engine, version=2):
        mig = mig_of(gpu_instance.gpu)
        slices = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}.get(number)
        profile, _ = mig.instances[gpu_instance.gi]
        if slices is None or slices > mig.profiles[profile][1]:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(id=number, sliceCount=slices)

    def create_ci(gpu_instance, profile_id):
        _, cis = mig_of(gpu_instance.gpu).instances[gpu_instance.gi]
        cis.append(len(cis))
        return types.SimpleNamespace(gpu_instance=gpu_instance, ci=cis[-1])

    def ci_by_id(gpu_instance, ci):
        return types.SimpleNamespace(gpu_instance=gpu_instance, ci=ci)

    def destroy_ci(compute):
        gpu_instance = compute.gpu_instance
        mig_of(gpu_instance.gpu).instances[gpu_instance.gi][1].remove(compute.ci)

    def destroy_gi(gpu_instance):
        mig = mig_of(gpu_instance.gpu)
        if mig.instances[gpu_instance.gi][1]:
            raise NVMLError("In use by another client")
        del mig.instances[gpu_instance.gi]

    def name(handle):
        if hasattr(handle, "ci"):
            return f"{handle.gpu.name} MIG {handle.gpu.mig.profiles[handle.profile][0]}"
        return handle.name

    def uuid(handle):
        if hasattr(handle, "ci"):
            return f"MIG-{handle.gpu.uuid[4:]}-{handle.gi}-{handle.ci}"
        return handle.uuid

    module.nvmlDeviceGetName = call("name", name)
    module.nvmlDeviceGetUUID = call("uuid", uuid)
    module.nvmlDeviceGetIndex = call("index", lambda handle: listed.index(handle))
    module.nvmlDeviceGetMigMode = call("mig mode", lambda h: [mig_of(h).current, mig_of(h).pending])
    module.nvmlDeviceSetMigMode = call("set mig mode", set_mode)
    module.nvmlDeviceGetMaxMigDeviceCount = call("max mig", lambda h: 7 if mig_of(h) else 0)
    module.nvmlDeviceGetMigDeviceHandleByIndex = call("mig device", mig_device)
    module.nvmlDeviceGetGpuInstanceId = call("gi id", lambda m: m.gi)
    module.nvmlDeviceGetComputeInstanceId = call("ci id", lambda m: m.ci)
    module.nvmlDeviceGetGpuInstanceProfileInfo = call("gi profile", profile_info)
    module.nvmlDeviceCreateGpuInstance = call("create gi", create_gi)
    module.nvmlDeviceGetGpuInstanceById = call("gi", gi_by_id)
    module.nvmlGpuInstanceGetComputeInstanceProfileInfo = call("ci profile", ci_profile)
    module.nvmlGpuInstanceCreateComputeInstance = call("create ci", create_ci)
    module.nvmlGpuInstanceGetComputeInstanceById = call("ci", ci_by_id)
    module.nvmlComputeInstanceDestroy = call("destroy ci", destroy_ci)
    module.nvmlGpuInstanceDestroy = call("destroy gi", destroy_gi)
