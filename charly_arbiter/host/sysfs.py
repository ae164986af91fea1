"""The PCI side of sysfs: one path builder, reading functions, and switching drivers.

`Sysfs(root)` is the only place that knows the layout under /sys; every path
is built from a validated address (or driver name) and must resolve to
somewhere under the root.  Switching follows libvirt's
`virPCIDeviceBindWithDriverOverride`: look at the current driver first and do
nothing when it is already right; `driver_override`, unbind, `drivers_probe`;
then verify the driver link (and `/dev/vfio/N`), because `drivers_probe`
succeeds even when no driver takes the device.  A token switches as a whole,
all or none: a failure undoes only the functions this call changed.

Every write that can block in the kernel (unbinding `nvidia` while anything
holds the GPU; unbinding `vfio-pci` while a VM has the device open) runs under
`blocking.bounded`, and with `isolate` it is made by a helper process
(`blocking.ChildWriter`), so that a write stuck in the kernel strands the helper, not the
caller's process.  A write that hangs marks its device hung: no more writes go
to it from this process, no undo is attempted on the token, and the caller gets
`SwitchHung` at once, for the arbiter to poison the token.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.core.host import (
    NO_DRIVER,
    PciFunction,
    Sriov,
    Vgpu,
    parse_vgpu_types,
    sriov_enabled_why,
)
from charly_arbiter.core.model import VFIO, target_label
from charly_arbiter.core.pci import parse_address
from charly_arbiter.errors import HostError, SwitchFailed, SwitchHung
from charly_arbiter.host.blocking import ChildWriter, TimedOut, Writer, bounded

log = logging.getLogger(__name__)

SYS_ROOT = Path("/sys")
PROC_ROOT = Path("/proc")
DEV_ROOT = Path("/dev")
RUN_ROOT = Path("/run")


@dataclass(frozen=True)
class Roots:
    """Where the kernel's file systems are: the only place that spells /sys, /proc,
    /dev and /run.  Tests and a real kernel under QEMU pass other roots."""

    sys: Path = SYS_ROOT
    proc: Path = PROC_ROOT
    dev: Path = DEV_ROOT
    run: Path = RUN_ROOT


# This machine's: what a host, a holder source or a hook is given unless a test or
# the real kernel under QEMU gives it other roots.
HOST_ROOTS = Roots()


BRIDGE_CLASS = "0604"
_POLL = 0.005


def write_attribute(path: Path, text: str) -> None:
    """One write(2) of `text`, as the kernel's sysfs store functions expect."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _check_driver_name(name: str) -> str:
    if not name or name in (".", "..") or any(c in name for c in "/\0\n\t ") or len(name) > 64:
        raise HostError(f"{name!r} is not a driver name")
    return name


class Sysfs:
    """Paths under a sysfs root, plus reads of the PCI attributes the arbiter needs."""

    def __init__(self, root: Path = SYS_ROOT, writer: Writer = write_attribute) -> None:
        self.root = root
        self.writer = writer
        self.pci = root / "bus" / "pci"
        self.iommu_groups = root / "kernel" / "iommu_groups"
        self._checked: dict[str, Path] = {}

    def device(self, address: str) -> Path:
        """`bus/pci/devices/ADDR`, for a strictly valid address that resolves under the root.

        A device that exists is checked once and remembered: its sysfs link
        never moves while it exists, and a switch reads it a dozen times.
        """
        cached = self._checked.get(address)
        if cached is not None:
            return cached
        path = self.pci / "devices" / parse_address(address)
        if path.exists():
            if not path.resolve().is_relative_to(self.root.resolve()):
                raise HostError(f"{address}: {path} resolves outside {self.root}")
            self._checked[address] = path
        return path

    def driver(self, name: str) -> Path:
        return self.pci / "drivers" / _check_driver_name(name)

    def drivers_probe(self) -> Path:
        return self.pci / "drivers_probe"

    def addresses(self) -> list[str]:
        """Every PCI function the kernel lists, in address order."""
        directory = self.pci / "devices"
        if not directory.is_dir():
            return []
        return sorted(entry.name for entry in directory.iterdir() if _is_address(entry.name))

    def exists(self, address: str) -> bool:
        return self.device(address).exists()

    def attribute(self, address: str, name: str) -> str:
        try:
            return (self.device(address) / name).read_text().strip()
        except OSError:
            return ""

    def modalias(self, address: str) -> str:
        """What udev matches against modules.alias (`pci:v…d…sv…sd…bc…sc…i…`): the
        kernel's own `modalias`, or the same string built from the ids it is made of."""
        alias = self.attribute(address, "modalias")
        if alias:
            return alias

        def hex_id(name: str, digits: int) -> str:
            value = self.attribute(address, name).removeprefix("0x").upper() or "0"
            return value.zfill(digits)

        klass = hex_id("class", 6)
        return (
            f"pci:v{hex_id('vendor', 8)}d{hex_id('device', 8)}"
            f"sv{hex_id('subsystem_vendor', 8)}sd{hex_id('subsystem_device', 8)}"
            f"bc{klass[0:2]}sc{klass[2:4]}i{klass[4:6]}"
        )

    def config_vendor(self, address: str) -> int | None:
        """The vendor id in the function's configuration space (0xffff: it does not
        answer on the bus, as after a failed reset); None when it cannot be read."""
        try:
            with (self.device(address) / "config").open("rb") as config:
                raw = config.read(2)
        except OSError:
            return None
        return int.from_bytes(raw, "little") if len(raw) == 2 else None

    def current_driver(self, address: str) -> str | None:
        return self._link_name(address, "driver")

    def iommu_group(self, address: str) -> str | None:
        return self._link_name(address, "iommu_group")

    def group_addresses(self, group: str) -> list[str]:
        directory = self.iommu_groups / group / "devices"
        try:
            return sorted(entry.name for entry in directory.iterdir() if _is_address(entry.name))
        except OSError:
            return []

    def physfn(self, address: str) -> str | None:
        """The physical function of a virtual function (None: it is not one)."""
        return self._link_name(address, "physfn")

    def sriov(self, address: str) -> Sriov | None:
        """A physical function's SR-IOV side (None: it has no SR-IOV capability).

        The virtual functions are the `virtfnN` links; `sriov_numvfs` is never
        read here, because reading it blocks while a change of the count is
        stuck in the kernel (see `Sriov`).  `sriov_totalvfs` takes no lock.
        """
        total = self.attribute(address, "sriov_totalvfs")
        if not total.isdigit():
            return None
        try:
            names = os.listdir(self.device(address))
        except OSError:
            names = []
        links = sorted(
            (int(name[6:]), name)
            for name in names
            if name.startswith("virtfn") and name[6:].isdigit()
        )
        vfs = (self._link_name(address, name) for _, name in links)
        offset, stride = (
            self.attribute(address, name) for name in ("sriov_offset", "sriov_stride")
        )
        return Sriov(
            int(total),
            tuple(vf for vf in vfs if vf is not None),
            int(offset) if offset.isdigit() else 1,
            int(stride) if stride.isdigit() else 1,
        )

    def vgpu(self, address: str) -> Vgpu | None:
        """An NVIDIA vGPU VF's types (None: the function has no `nvidia/` vGPU files)."""
        creatable = self.attribute(address, "nvidia/creatable_vgpu_types")
        current = self.attribute(address, "nvidia/current_vgpu_type")
        if not current.isdigit():
            return None
        return Vgpu(parse_vgpu_types(creatable), int(current))

    def _link_name(self, address: str, link: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self.device(address) / link))
        except OSError:
            return None

    def function(self, address: str) -> PciFunction:
        if not self.exists(address):
            raise HostError(f"there is no PCI device {address} under {self.pci / 'devices'}")
        return PciFunction(
            address=address,
            vendor=self.attribute(address, "vendor").removeprefix("0x"),
            device=self.attribute(address, "device").removeprefix("0x"),
            pci_class=self.attribute(address, "class").removeprefix("0x"),
            driver=self.current_driver(address),
            iommu_group=self.iommu_group(address),
            physfn=self.physfn(address),
            sriov=self.sriov(address),
            vgpu=self.vgpu(address),
        )

    def group_functions(self, address: str) -> list[PciFunction]:
        """The function at `address` and every other endpoint of its IOMMU group.

        Bridges are skipped, as libvirt, Proxmox and Incus do: they stay with
        the host and vfio-pci refuses them anyway.
        """
        function = self.function(address)
        if function.iommu_group is None:
            return [function]
        members = [self.function(a) for a in self.group_addresses(function.iommu_group)]
        endpoints = [m for m in members if not m.pci_class.startswith(BRIDGE_CLASS)]
        if all(m.address != address for m in endpoints):
            endpoints.insert(0, function)
        return endpoints


def _is_address(name: str) -> bool:
    try:
        parse_address(name)
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class Step:
    """One function moved from one driver to another (what undo reverses)."""

    address: str
    from_driver: str | None
    to_driver: str


class Switcher:
    """Moves functions between drivers, all or none, never hanging the caller."""

    def __init__(
        self,
        sysfs: Sysfs,
        dev_root: Path = DEV_ROOT,
        timeout: float = 15.0,
        load_module: Callable[[str], None] | None = None,
        bind_wait: float = 5.0,
        isolate: bool = False,
    ) -> None:
        self.sysfs = sysfs
        self.dev_root = dev_root
        self.timeout = timeout
        # drivers_probe binds synchronously unless a driver probes asynchronously;
        # this bounds how long a bind that is not there yet is waited for.
        self.bind_wait = min(bind_wait, timeout)
        self.load_module = load_module
        self.hung: dict[str, str] = {}  # address -> the step that never returned
        # unbind and drivers_probe can block in a driver; `isolate` runs them in a child.
        self.blocking_writer = ChildWriter(sysfs.writer) if isolate else sysfs.writer

    def switch(self, targets: Mapping[str, str]) -> list[Step]:
        """Bind each address to its target (a driver, or NO_DRIVER); verify; undo on failure."""
        for address in targets:
            self._refuse_hung(address, targets[address])
        done: list[Step] = []
        for address, target in sorted(targets.items()):
            before = self.sysfs.current_driver(address)
            try:
                step = self.bind(address, target, before)
            except SwitchHung:
                raise  # nothing more is written to a token with a hung device
            except SwitchFailed:
                # The failing function may be half-way (unbound): it goes back too.
                self._undo([*done, Step(address, before, target)])
                raise
            if step is not None:
                done.append(step)
        return done

    def close(self) -> None:
        if isinstance(self.blocking_writer, ChildWriter):
            self.blocking_writer.close()

    def _undo(self, done: Sequence[Step]) -> None:
        for step in reversed(done):
            back = step.from_driver or NO_DRIVER
            try:
                self.bind(step.address, back)
                log.info("%s: undone, back on %s", step.address, back or "(no driver)")
            except SwitchFailed as error:
                log.error("%s: could not undo the switch: %s", step.address, error)

    def bind(self, address: str, target: str, current: str | None = None) -> Step | None:
        """Move one function to `target`; None when it is already there.

        `current` is the driver the caller just read (read here when None).
        """
        self._refuse_hung(address, target)
        if current is None:
            current = self.sysfs.current_driver(address)
        wanted_override = VFIO if target == VFIO else ""
        if _arrived(current, target):
            override = self.sysfs.attribute(address, "driver_override")
            if override in ("", "(null)", wanted_override):
                return None
        if target != NO_DRIVER and not self.sysfs.driver(target).is_dir() and self.load_module:
            self.load_module(target)  # as libvirt does for the stub; the home driver too
        if target == VFIO and not self.sysfs.driver(VFIO).is_dir():
            raise SwitchFailed(
                address, VFIO, "check driver", "vfio-pci is not loaded (run `modprobe vfio-pci`)"
            )
        device = self.sysfs.device(address)
        log.info("%s: %s -> %s", address, current or "(no driver)", target or "its default driver")
        # Storing the override only copies a string: it cannot block, so no watchdog.
        self._store(
            address, target, "driver_override", device / "driver_override", wanted_override + "\n"
        )
        self._rebind(
            address, target, device, unbind=current is not None and not _arrived(current, target)
        )
        self._verify(address, target)
        return Step(address, current, target)

    def _refuse_hung(self, address: str, target: str) -> None:
        if parse_address(address) in self.hung:
            raise SwitchFailed(
                address,
                target_label(target),
                self.hung[address],
                "an earlier write to this device never returned; nothing more is written to it",
            )

    def _store(self, address: str, target: str, step: str, path: Path, text: str) -> None:
        try:
            self.sysfs.writer(path, text)
        except OSError as error:
            raise SwitchFailed(
                address, target_label(target), step, error.strerror or str(error)
            ) from None

    def _rebind(self, address: str, target: str, device: Path, unbind: bool) -> None:
        """Unbind (when bound elsewhere) and probe, under one watchdog.

        Both writes can block inside a driver (remove or probe); one watchdog
        thread for the pair keeps the step that hung exact and the cost low.
        """
        writer = self.blocking_writer
        step = ["unbind" if unbind else "drivers_probe"]

        def act() -> None:
            if unbind:
                writer(device / "driver" / "unbind", address)
            step[0] = "drivers_probe"
            if address in self.hung:
                return  # the unbind came back after the watchdog gave up: leave it be
            if self.sysfs.current_driver(address) is None:
                writer(self.sysfs.drivers_probe(), address)

        label = target_label(target)
        try:
            bounded(act, self.timeout, f"sysfs {address} {step[0]}")
        except TimedOut:
            self.hung[address] = step[0]
            log.error("%s: writing %s did not return within %g s", address, step[0], self.timeout)
            raise SwitchHung(address, label, step[0], self.timeout) from None
        except OSError as error:
            raise SwitchFailed(address, label, step[0], error.strerror or str(error)) from None

    def _verify(self, address: str, target: str) -> None:
        """Wait (bounded) for the bind, then check the driver link and, for vfio, the node."""
        deadline = time.monotonic() + self.bind_wait
        while True:
            current = self.sysfs.current_driver(address)
            node = self.vfio_node(address) if target == VFIO else None
            if _arrived(current, target) and (node is None or node.exists()):
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
        if not _arrived(current, target):
            why = f"the device is bound to {current}" if current else "no driver took the device"
            sriov = self.sysfs.sriov(address) if target == VFIO and current is None else None
            if sriov is not None and sriov.vfs:
                why = sriov_enabled_why(sriov.num_vfs)
            raise SwitchFailed(address, target_label(target), "verify", why)
        raise SwitchFailed(address, VFIO, "verify", f"{node} did not appear")

    def vfio_node(self, address: str) -> Path | None:
        group = self.sysfs.iommu_group(address)
        return self.dev_root / "vfio" / group if group is not None else None


def _arrived(current: str | None, target: str) -> bool:
    if target == NO_DRIVER:
        return current != VFIO
    return current == target
