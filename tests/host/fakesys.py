"""A fake sysfs (and /dev) tree in a temp directory whose writes behave like the kernel.

Modelled on libvirt's `tests/virpcimock.c`: the tree has the real layout
(`bus/pci/devices/ADDR` symlinks into `devices/`, `driver` and `iommu_group`
links, `bus/pci/drivers/NAME`, `kernel/iommu_groups/N/devices`), and the
writer the code under test is given interprets writes to `driver_override`,
`driver/unbind` and `drivers_probe` the way the kernel does: unbind removes the
driver link, probe binds the override (or the device's native driver) when
that driver is loaded, and vfio-pci creates `/dev/vfio/N`.  Per-driver flags
make a probe fail silently (as `drivers_probe` does) or an unbind hang.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class FakeDevice:
    address: str
    vendor: str
    device: str
    pci_class: str
    native: str | None  # the driver that matches it without an override
    group: str | None
    boot_vga: bool = False
    drm: tuple[str, ...] = ()  # e.g. ("card0", "renderD128") while bound to `native`


@dataclass
class FakeKernel:
    root: Path
    loaded: set[str] = field(default_factory=lambda: {"vfio-pci"})
    refuse_probe: set[str] = field(default_factory=set)  # drivers whose probe fails
    hang_unbind: set[str] = field(default_factory=set)  # drivers whose unbind blocks
    writes: list[tuple[str, str]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.sys = self.root / "sys"
        self.dev = self.root / "dev"
        self.proc = self.root / "proc"
        self.devices: dict[str, FakeDevice] = {}
        for path in (self.sys / "bus/pci/devices", self.sys / "bus/pci/drivers", self.dev):
            path.mkdir(parents=True, exist_ok=True)
        (self.sys / "bus/pci/drivers_probe").write_text("")
        (self.sys / "kernel/iommu_groups").mkdir(parents=True, exist_ok=True)
        for name in self.loaded:
            self.load(name)

    # -- building the tree ---------------------------------------------------------

    def load(self, driver: str) -> None:
        self.loaded.add(driver)
        directory = self.sys / "bus/pci/drivers" / driver
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("bind", "unbind", "new_id"):
            (directory / name).touch()
        if driver == "vfio-pci":
            (self.dev / "vfio").mkdir(exist_ok=True)
            (self.dev / "vfio" / "vfio").touch()

    def unload(self, driver: str) -> None:
        self.loaded.discard(driver)
        directory = self.sys / "bus/pci/drivers" / driver
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()

    def add(self, device: FakeDevice) -> None:
        self.devices[device.address] = device
        real = self.sys / "devices" / "pci0000:00" / device.address
        real.mkdir(parents=True)
        (real / "vendor").write_text(f"0x{device.vendor}\n")
        (real / "device").write_text(f"0x{device.device}\n")
        (real / "class").write_text(f"0x{device.pci_class}\n")
        (real / "driver_override").write_text("(null)\n")
        if device.boot_vga:
            (real / "boot_vga").write_text("1\n")
        os.symlink(f"../../../devices/pci0000:00/{device.address}", self.device_dir(device.address))
        if device.group is not None:
            group = self.sys / "kernel/iommu_groups" / device.group / "devices"
            group.mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../../../devices/pci0000:00/{device.address}", group / device.address)
            os.symlink(f"../../../kernel/iommu_groups/{device.group}", real / "iommu_group")
        if device.native in self.loaded:
            self._bind(device.address, device.native)

    def device_dir(self, address: str) -> Path:
        return self.sys / "bus/pci/devices" / address

    def driver_of(self, address: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self.device_dir(address) / "driver"))
        except OSError:
            return None

    def drivers(self) -> dict[str, str | None]:
        return {address: self.driver_of(address) for address in self.devices}

    # -- the kernel's side of the writes ---------------------------------------------

    def write(self, path: Path, text: str) -> None:
        """The writer handed to `Sysfs`: acts like the sysfs store functions."""
        relative = path.relative_to(self.sys)
        self.writes.append((str(relative), text))
        if path.name == "driver_override":
            value = text.strip()
            path.write_text((value or "(null)") + "\n")
        elif path.name == "unbind":
            address = text.strip()
            current = self.driver_of(address)
            if current is None:
                raise OSError(19, "No such device")
            if current in self.hang_unbind:
                self.release.wait()  # blocks like nvidia's remove with a user left
            self._unbind(address)
        elif path.name == "drivers_probe":
            self._probe(text.strip())
        else:
            path.write_text(text)

    def _probe(self, address: str) -> None:
        if self.driver_of(address) is not None:
            return
        device = self.devices[address]
        override = (self.device_dir(address) / "driver_override").read_text().strip()
        wanted = device.native if override in ("", "(null)") else override
        if wanted is None or wanted not in self.loaded or wanted in self.refuse_probe:
            return  # like the kernel: drivers_probe succeeds, nothing binds
        self._bind(address, wanted)

    def _bind(self, address: str, driver: str) -> None:
        device = self.devices[address]
        real = self.device_dir(address).resolve()
        os.symlink(f"../../../bus/pci/drivers/{driver}", real / "driver")
        (self.sys / "bus/pci/drivers" / driver / address).symlink_to(real)
        if driver == "vfio-pci" and device.group is not None:
            (self.dev / "vfio" / device.group).touch()
        if driver == device.native and device.drm:
            (real / "drm").mkdir(exist_ok=True)
            (self.dev / "dri").mkdir(exist_ok=True)
            for name in device.drm:
                (real / "drm" / name).mkdir(exist_ok=True)
                (self.dev / "dri" / name).touch()

    def _unbind(self, address: str) -> None:
        device = self.devices[address]
        real = self.device_dir(address).resolve()
        driver = self.driver_of(address)
        (real / "driver").unlink()
        (self.sys / "bus/pci/drivers" / str(driver) / address).unlink()
        if driver == "vfio-pci" and device.group is not None:
            others = [
                a for a, d in self.devices.items() if d.group == device.group and a != address
            ]
            if not any(self.driver_of(a) == "vfio-pci" for a in others):
                (self.dev / "vfio" / device.group).unlink(missing_ok=True)
        if driver == device.native:
            for name in device.drm:
                (real / "drm" / name).rmdir()
                (self.dev / "dri" / name).unlink(missing_ok=True)


def gpu_with_audio(root: Path) -> FakeKernel:
    """An NVIDIA GPU at 0a:00.0 with its HDMI audio at 0a:00.1 (group 12), a bridge in
    the same group, a second GPU alone in group 13, and a SATA controller in group 14."""
    kernel = FakeKernel(root, loaded={"vfio-pci", "nvidia", "snd_hda_intel", "ahci", "pcieport"})
    kernel.add(FakeDevice("0000:00:01.0", "8086", "1901", "060400", "pcieport", "12"))
    kernel.add(FakeDevice("0000:0a:00.0", "10de", "2684", "030000", "nvidia", "12", drm=("card1",)))
    kernel.add(FakeDevice("0000:0a:00.1", "10de", "22ba", "040300", "snd_hda_intel", "12"))
    kernel.add(
        FakeDevice(
            "0000:0b:00.0", "8086", "a780", "030000", "i915", "13", boot_vga=True, drm=("card0",)
        )
    )
    kernel.add(FakeDevice("0000:00:17.0", "8086", "7ae2", "010601", "ahci", "14"))
    return kernel
