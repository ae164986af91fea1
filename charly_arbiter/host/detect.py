"""What this machine has for the arbiter: PCI functions, GPUs, VFIO readiness.

Functions are enumerated with pyudev (subsystem `pci`) on the real /sys and
read through `Sysfs`, so the same code reads a fake tree in tests.  NVIDIA
GPUs are described by NVML where it works, by sysfs otherwise (and the
result says which); AMD GPUs get their gfx target from the KFD topology.
Labels, vendors and node patterns come from `data/pci.toml`.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from charly_arbiter.core.host import PciFunction, ScreenUse, TokenSpec
from charly_arbiter.core.model import VFIO
from charly_arbiter.core.pci import slot_of
from charly_arbiter.host.local import LocalHost
from charly_arbiter.host.nvml import NvmlGpu
from charly_arbiter.host.pcidata import function_nodes, pci_data
from charly_arbiter.host.sysfs import BRIDGE_CLASS, SYS_ROOT

DEFAULT_VM_MEMORY_MIB = 8192


@dataclass(frozen=True)
class SriovInfo:
    """A physical function's SR-IOV capability, as `detect` shows it."""

    total_vfs: int
    num_vfs: int  # the virtfnN links (sriov_numvfs is not read: it can block)
    vfs: tuple[str, ...]
    offset: int | None  # routing-id offset of the first VF, and the stride between them
    stride: int | None
    vf_device: str | None  # the VFs' device id
    drivers_autoprobe: bool | None  # whether new VFs are offered to drivers


@dataclass(frozen=True)
class FunctionInfo:
    address: str
    vendor: str
    vendor_name: str
    device: str
    pci_class: str
    class_label: str
    driver: str | None
    iommu_group: str | None
    group_members: tuple[str, ...]
    nodes: tuple[str, ...]
    boot_vga: bool
    # How the kernel can reset it (`reset_method`, Linux >= 5.15: "flr", "bus", ...);
    # "" when it cannot be reset at all, None when this kernel does not say.
    reset_method: str | None
    physfn: str | None = None  # a virtual function's physical function
    sriov: SriovInfo | None = None  # a function that can have virtual functions


@dataclass(frozen=True)
class GpuInfo:
    address: str
    vendor_name: str
    source: str  # "nvml" or "sysfs"
    name: str
    uuid: str | None
    memory_total: int | None
    processes: tuple[int, ...]
    gfx_target: str | None
    viable: bool
    not_viable_because: tuple[str, ...]
    vfio_node: str | None
    vfio_node_accessible: bool | None
    physfn: str | None = None  # a virtual function: not a GPU of its own
    vfs: tuple[str, ...] = ()  # the virtual functions this GPU has enabled
    # Who uses its screen (ScreenUse.as_json): boot display, console, sessions.
    screen: dict[str, Any] | None = None


@dataclass(frozen=True)
class VfioReadiness:
    iommu_on: bool
    iommu_groups: int
    vfio_pci: str  # "loaded", "available" or "missing"
    vfio_container: bool
    memlock_soft: int | None  # bytes; None = unlimited
    memlock_hard: int | None
    vm_memory: int
    memlock_enough: bool


@dataclass(frozen=True)
class Detection:
    functions: tuple[FunctionInfo, ...]
    gpus: tuple[GpuInfo, ...]
    vfio: VfioReadiness
    nvml: str  # "used", or why NVML was not used


def pci_addresses(host: LocalHost) -> list[str]:
    """pyudev's view of subsystem `pci` on the real /sys; the tree itself elsewhere."""
    if host.sysfs.root == SYS_ROOT:
        try:
            import pyudev

            context = pyudev.Context()
            return sorted(device.sys_name for device in context.list_devices(subsystem="pci"))
        except ImportError:
            pass
    return host.sysfs.addresses()


def describe_function(host: LocalHost, address: str) -> FunctionInfo:
    data = pci_data()
    function = host.sysfs.function(address)
    group = function.iommu_group
    members = tuple(host.sysfs.group_addresses(group)) if group is not None else ()
    nodes = function_nodes(host.sysfs, host.dev_root, host.proc_root, function)
    return FunctionInfo(
        address=address,
        vendor=function.vendor,
        vendor_name=data.vendor_name(function.vendor),
        device=function.device,
        pci_class=function.pci_class,
        class_label=data.class_label(function.pci_class),
        driver=function.driver,
        iommu_group=group,
        group_members=tuple(member for member in members if member != address),
        nodes=tuple(sorted(nodes)),
        boot_vga=host.sysfs.attribute(address, "boot_vga") == "1",
        reset_method=_reset_method(host, address),
        physfn=function.physfn,
        sriov=_sriov_info(host, function),
    )


def _sriov_info(host: LocalHost, function: PciFunction) -> SriovInfo | None:
    """The capability's other attributes, none of which takes the device lock."""
    if function.sriov is None:
        return None

    def number(name: str) -> int | None:
        value = host.sysfs.attribute(function.address, name)
        return int(value) if value.isdigit() else None

    autoprobe = host.sysfs.attribute(function.address, "sriov_drivers_autoprobe")
    return SriovInfo(
        total_vfs=function.sriov.total_vfs,
        num_vfs=function.sriov.num_vfs,
        vfs=function.sriov.vfs,
        offset=number("sriov_offset"),
        stride=number("sriov_stride"),
        vf_device=host.sysfs.attribute(function.address, "sriov_vf_device") or None,
        drivers_autoprobe={"1": True, "0": False}.get(autoprobe),
    )


def _reset_method(host: LocalHost, address: str) -> str | None:
    """Linux 5.15 and later show `reset_method` only for a device that has one."""
    path = host.sysfs.device(address) / "reset_method"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return "" if _kernel_at_least(host, (5, 15)) else None
    except OSError:
        return ""


def _kernel_at_least(host: LocalHost, wanted: tuple[int, int]) -> bool:
    try:
        release = (host.proc_root / "sys" / "kernel" / "osrelease").read_text()
        major, minor = (int(part) for part in release.split(".")[:2])
    except (OSError, ValueError):
        return False
    return (major, minor) >= wanted


def group_problems(functions: dict[str, FunctionInfo], gpu: FunctionInfo) -> list[str]:
    """Why this GPU's IOMMU group cannot go to a VM (empty: it can)."""
    if gpu.iommu_group is None:
        return ["it has no IOMMU group (is the IOMMU on?)"]
    problems = []
    for address in (gpu.address, *gpu.group_members):
        member = functions.get(address)
        if member is None or member.pci_class.startswith(BRIDGE_CLASS):
            continue
        reason = pci_data().critical_reason(member.pci_class)
        if reason:
            problems.append(f"{address} in its group is {reason} ({member.class_label})")
        elif slot_of(address) != slot_of(gpu.address):
            problems.append(
                f"{address} ({member.class_label}) shares its IOMMU group without being one "
                "of its functions, and would leave the host with it"
            )
        if member.boot_vga:
            problems.append(f"{address} is the boot display")
    if gpu.sriov is not None and gpu.sriov.num_vfs:
        problems.append(
            f"it has {gpu.sriov.num_vfs} virtual function(s) enabled "
            f"({', '.join(gpu.sriov.vfs)}): vfio-pci does not take a physical function "
            "with SR-IOV enabled; pass a virtual function through, or set its sriov_numvfs to 0"
        )
    return problems


def amd_gfx_targets(sys_root: Path) -> dict[str, str]:
    """address -> gfx target (`gfx1100`), from the KFD topology."""
    nodes = sys_root / "class" / "kfd" / "kfd" / "topology" / "nodes"
    targets: dict[str, str] = {}
    try:
        entries = sorted(nodes.iterdir())
    except OSError:
        return targets
    for node in entries:
        try:
            lines = (node / "properties").read_text().splitlines()
        except OSError:
            continue
        properties = dict(line.split(None, 1) for line in lines if len(line.split(None, 1)) == 2)
        version = int(properties.get("gfx_target_version", "0") or 0)
        location = int(properties.get("location_id", "0") or 0)
        if version == 0:
            continue  # a CPU node
        domain = int(properties.get("domain", "0") or 0)
        address = f"{domain:04x}:{location >> 8:02x}:{(location >> 3) & 0x1F:02x}.{location & 7:x}"
        major, minor, step = version // 10000, (version // 100) % 100, version % 100
        targets[address] = f"gfx{major}{minor:x}{step:x}"
    return targets


def vfio_readiness(host: LocalHost, vm_memory: int) -> VfioReadiness:
    groups = host.sysfs.iommu_groups
    count = len(list(groups.iterdir())) if groups.is_dir() else 0
    if host.sysfs.driver(VFIO).is_dir():
        vfio_pci = "loaded"
    else:
        vfio_pci = "available" if host.modules.has("vfio_pci") else "missing"
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    soft_value = None if soft == resource.RLIM_INFINITY else soft
    hard_value = None if hard == resource.RLIM_INFINITY else hard
    return VfioReadiness(
        iommu_on=count > 0,
        iommu_groups=count,
        vfio_pci=vfio_pci,
        vfio_container=(host.dev_root / "vfio" / "vfio").exists(),
        memlock_soft=soft_value,
        memlock_hard=hard_value,
        vm_memory=vm_memory,
        memlock_enough=soft_value is None or soft_value >= vm_memory,
    )


def detect(host: LocalHost, vm_memory: int = DEFAULT_VM_MEMORY_MIB * 2**20) -> Detection:
    functions = {address: describe_function(host, address) for address in pci_addresses(host)}
    display = [f for f in functions.values() if f.pci_class.startswith("03")]
    nvml_gpus: dict[str, NvmlGpu] = {}
    nvml_note = "no NVIDIA GPU"
    if any(f.vendor == "10de" for f in display):
        nvml_gpus = host.nvml.gpus()
        nvml_note = "used" if host.nvml.error is None else f"{host.nvml.error}; using sysfs"
        host.nvml.close()
    gfx = amd_gfx_targets(host.sysfs.root) if any(f.vendor == "1002" for f in display) else {}
    gpus = []
    for function in display:
        problems = group_problems(functions, function)
        nvml = nvml_gpus.get(function.address)
        node = host.dev_root / "vfio" / function.iommu_group if function.iommu_group else None
        gpus.append(
            GpuInfo(
                address=function.address,
                vendor_name=function.vendor_name,
                source="nvml" if nvml else "sysfs",
                name=nvml.name
                if nvml
                else f"{function.vendor_name} {function.class_label}"
                f" [{function.vendor}:{function.device}]",
                uuid=nvml.uuid if nvml else None,
                memory_total=nvml.memory_total if nvml else None,
                processes=tuple(p.pid for p in nvml.processes) if nvml else (),
                gfx_target=gfx.get(function.address),
                viable=not problems,
                not_viable_because=tuple(problems),
                vfio_node=str(node) if node is not None and node.exists() else None,
                vfio_node_accessible=(
                    os.access(node, os.R_OK | os.W_OK)
                    if node is not None and node.exists()
                    else None
                ),
                physfn=function.physfn,
                vfs=function.sriov.vfs if function.sriov else (),
                screen=None if function.physfn else screen_of(host, function.address).as_json(),
            )
        )
    return Detection(
        tuple(functions.values()), tuple(gpus), vfio_readiness(host, vm_memory), nvml_note
    )


def screen_of(host: LocalHost, address: str) -> ScreenUse:
    """Who uses the screen of the GPU at `address` and its IOMMU group, named as the
    configuration names its token (else by its address)."""
    name = next((t.name for t in host.config.tokens if t.address == address), address)
    functions = tuple(host.token_functions(name, address))
    return host.screen(TokenSpec(name, address, functions))


def document(detection: Detection) -> dict[str, Any]:
    return {
        "functions": [asdict(f) for f in detection.functions],
        "gpus": [asdict(g) for g in detection.gpus],
        "vfio": asdict(detection.vfio),
        "nvml": detection.nvml,
    }


def _size(value: int | None) -> str:
    return "unlimited" if value is None else f"{value / 2**20:g} MiB"


def _reset_label(method: str | None) -> str:
    if method is None:
        return ""
    return f", reset {method.replace(' ', '/')}" if method else ", no reset method"


def _sriov_label(function: FunctionInfo) -> str:
    if function.physfn:
        return f", virtual function of {function.physfn}"
    sriov = function.sriov
    if sriov is None:
        return ""
    vfs = f": {', '.join(sriov.vfs)}" if sriov.vfs else ""
    return f", SR-IOV {sriov.num_vfs} of {sriov.total_vfs} VFs{vfs}"


def render(detection: Detection) -> str:
    lines = ["PCI functions:"]
    for f in detection.functions:
        group = f"group {f.iommu_group}" if f.iommu_group is not None else "no group"
        lines.append(
            f"  {f.address} {f.vendor}:{f.device} {f.class_label} [{f.pci_class}]"
            f" {f.vendor_name}, driver {f.driver or '-'}, {group}"
            + (f" with {', '.join(f.group_members)}" if f.group_members else "")
            + (f", nodes {', '.join(f.nodes)}" if f.nodes else "")
            + _reset_label(f.reset_method)
            + _sriov_label(f)
        )
    lines += ["", "GPUs:"]
    if not detection.gpus:
        lines.append("  none")
    for g in detection.gpus:
        details = [f"from {g.source}"]
        if g.uuid:
            details.append(g.uuid)
        if g.memory_total:
            details.append(f"{g.memory_total / 2**30:.1f} GiB")
        if g.gfx_target:
            details.append(g.gfx_target)
        if g.processes:
            details.append(f"processes {', '.join(map(str, g.processes))}")
        lines.append(f"  {g.address} {g.name} ({'; '.join(details)})")
        if g.physfn:
            lines.append(f"    a virtual function of {g.physfn}, not a GPU of its own")
        if g.vfs:
            lines.append(f"    its virtual functions: {', '.join(g.vfs)}")
        if g.screen is not None:
            lines.append(f"    {g.screen['text']}")
        verdict = "viable for passthrough" if g.viable else "NOT viable for passthrough: "
        lines.append(f"    {verdict}{'; '.join(g.not_viable_because)}")
        if g.vfio_node:
            access = "accessible" if g.vfio_node_accessible else "not accessible"
            lines.append(f"    {g.vfio_node} exists, {access}")
    v = detection.vfio
    lines += [
        "",
        "VFIO:",
        f"  IOMMU: {'on' if v.iommu_on else 'OFF'} ({v.iommu_groups} groups)",
        f"  vfio-pci: {v.vfio_pci}",
        f"  /dev/vfio/vfio: {'present' if v.vfio_container else 'absent'}",
        f"  RLIMIT_MEMLOCK: {_size(v.memlock_soft)} (hard {_size(v.memlock_hard)}), "
        f"{'enough' if v.memlock_enough else 'NOT enough'} for a {_size(v.vm_memory)} VM",
        f"  NVML: {detection.nvml}",
    ]
    return "\n".join(lines)
