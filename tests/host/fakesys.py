"""A fake sysfs (and /dev) tree in a temp directory whose writes behave like the kernel.

Modelled on libvirt's `tests/virpcimock.c`: the tree has the real layout
(`bus/pci/devices/ADDR` symlinks into `devices/`, `driver` and `iommu_group`
links, `bus/pci/drivers/NAME`, `kernel/iommu_groups/N/devices`), and the
writer the code under test is given does what open(2) and the kernel's store
functions do (drivers/base/bus.c, drivers/pci/pci-driver.c, Linux 6.x), errors
included, so that code relying on a lenient fake fails here as it would on a
real host:

- the file must exist (no O_CREAT: ENOENT, e.g. `driver/unbind` of an unbound
  device) and be writable: every attribute but `driver_override`, the
  drivers' `bind`/`unbind`/`new_id` and the bus's `drivers_probe` is
  read-only, and sysfs refuses to open those for writing, even for root
  (EACCES; checked against the real /sys in test_fakesys.py);
- `unbind` through a driver the device is not bound to, or of an unknown
  device: ENODEV;
- `drivers_probe` of an unknown device: ENODEV; of a bound one: nothing; a
  probe that finds no driver, or whose driver refuses, succeeds silently;
- `bind` of an unknown device or one the driver does not match: ENODEV; of a
  bound device: EBUSY; a refused probe: ENODEV;
- `new_id` that is not at least two hex numbers: EINVAL; an id the driver
  already has: EEXIST; otherwise the driver takes every unbound device it
  now matches;
- a driver matches a device with `driver_override` set only when it is that
  driver (vfio-pci matches nothing without it, as since Linux 5.16).

Per-driver flags make a probe fail (silently, as `drivers_probe` does) or an
unbind hang; unloading a driver unbinds its devices first.
"""

from __future__ import annotations

import errno
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
    reset_method: str | None = "flr bus"  # None: a kernel older than 5.15 has no file
    framebuffer: str | None = None  # e.g. "fb0": the DRM driver's fbdev, while `native`


@dataclass
class FakeKernel:
    root: Path
    loaded: set[str] = field(default_factory=lambda: {"vfio-pci"})
    refuse_probe: set[str] = field(default_factory=set)  # drivers whose probe fails
    hang_unbind: set[str] = field(default_factory=set)  # drivers whose unbind blocks
    installed: set[str] = field(default_factory=set)  # drivers `modprobe` can load
    writes: list[tuple[str, str]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.sys = self.root / "sys"
        self.dev = self.root / "dev"
        self.proc = self.root / "proc"
        self.devices: dict[str, FakeDevice] = {}
        self.dynamic_ids: dict[str, set[tuple[str, str]]] = {}  # driver -> ids from new_id
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

    def fbcon(self, bound: bool = True) -> None:
        """The kernel's consoles: the VGA text console, and fbcon (bound: it draws on
        the framebuffers)."""
        for number, (name, state) in enumerate((("(S) VGA+", 0), ("(M) frame buffer device", 1))):
            vtcon = self.sys / "class/vtconsole" / f"vtcon{number}"
            vtcon.mkdir(parents=True, exist_ok=True)
            (vtcon / "name").write_text(name + "\n")
            (vtcon / "bind").write_text(f"{state if bound else 0}\n")

    def platform_framebuffer(self, driver: str = "efi-framebuffer") -> None:
        """The firmware's framebuffer (efifb, simpledrm) as a bound platform device."""
        directory = self.sys / "bus/platform/drivers" / driver
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "unbind").touch()
        device = self.sys / "devices/platform" / f"{driver}.0"
        device.mkdir(parents=True, exist_ok=True)
        (directory / f"{driver}.0").symlink_to(device)

    def modprobe(self, driver: str) -> None:
        """What the arbiter's module loader does on a real host: load an installed
        driver (which then takes the unbound devices it matches), else nothing."""
        if driver in self.installed and driver not in self.loaded:
            self.load(driver)
            for address in self.devices:
                if self.driver_of(address) is None and self._matches(driver, address):
                    self._bind(address, driver)

    def unload(self, driver: str) -> None:
        """Like rmmod: the driver lets go of its devices, then its directory goes."""
        for address in self.devices:
            if self.driver_of(address) == driver:
                self._unbind(address)
        self.loaded.discard(driver)
        self.dynamic_ids.pop(driver, None)
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
        (real / "modalias").write_text(
            f"pci:v0000{device.vendor.upper()}d0000{device.device.upper()}sv00001043sd000088E2"
            f"bc{device.pci_class[0:2]}sc{device.pci_class[2:4]}i{device.pci_class[4:6]}\n"
        )
        (real / "driver_override").write_text("(null)\n")
        # The first 64 bytes of configuration space: vendor and device id, little endian.
        config = int(device.vendor, 16).to_bytes(2, "little") + int(device.device, 16).to_bytes(
            2, "little"
        )
        (real / "config").write_bytes(config + bytes(60))
        if device.boot_vga:
            (real / "boot_vga").write_text("1\n")
        if device.reset_method is not None:
            (real / "reset_method").write_text(f"{device.reset_method}\n")
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
        """The writer handed to `Sysfs`: open(2) without O_CREAT, then the store function."""
        relative = path.relative_to(self.sys)
        self.writes.append((str(relative), text))
        if path.is_dir():
            raise _error(errno.EISDIR, path)
        if not path.exists():
            raise _error(errno.ENOENT, path)
        owner = path.parent.resolve()
        attribute = path.name
        if owner.parent == self._real_devices() and attribute == "driver_override":
            self._store_override(path, text)
        elif owner.parent == self._drivers() and attribute == "unbind":
            self._store_unbind(owner.name, _device_name(text))
        elif owner.parent == self._drivers() and attribute == "bind":
            self._store_bind(owner.name, _device_name(text))
        elif owner.parent == self._drivers() and attribute == "new_id":
            self._store_new_id(owner.name, text)
        elif owner == self._bus() and attribute == "drivers_probe":
            self._store_probe(_device_name(text))
        elif owner.parent == (self.sys / "class/vtconsole").resolve() and attribute == "bind":
            if text.strip() not in ("0", "1"):
                raise _error(errno.EINVAL, path)
            path.write_text(text.strip() + "\n")  # con_store_bind: fbcon unbound or bound
        elif (
            owner.parent == (self.sys / "bus/platform/drivers").resolve() and attribute == "unbind"
        ):
            device = owner / text.strip()
            if not device.is_symlink():
                raise _error(errno.ENODEV, path)
            device.unlink()
        else:
            raise _error(errno.EACCES, path)  # a read-only attribute (mode 0444)

    def _store_override(self, path: Path, text: str) -> None:
        if len(text) >= 4095:  # PAGE_SIZE - 1
            raise _error(errno.EINVAL, path)
        value = text.split("\n", 1)[0]  # up to the first newline; empty clears it
        path.write_text((value or "(null)") + "\n")

    def _store_unbind(self, driver: str, address: str) -> None:
        if address not in self.devices or self.driver_of(address) != driver:
            raise _error(errno.ENODEV)
        if driver in self.hang_unbind:
            self.release.wait()  # blocks like nvidia's remove with a user left
        self._unbind(address)

    def _store_bind(self, driver: str, address: str) -> None:
        if address not in self.devices or not self._matches(driver, address):
            raise _error(errno.ENODEV)
        if self.driver_of(address) is not None:
            raise _error(errno.EBUSY)
        if driver in self.refuse_probe:
            raise _error(errno.ENODEV)
        self._bind(address, driver)

    def _store_new_id(self, driver: str, text: str) -> None:
        fields = text.split()
        try:
            vendor, device = (f"{int(field, 16):04x}" for field in fields[:2])
            for field in fields[2:]:
                int(field, 16)
        except ValueError:  # fewer than two numbers, or one that is not hex
            raise _error(errno.EINVAL) from None
        known = self.dynamic_ids.setdefault(driver, set())
        natives = {(d.vendor, d.device) for d in self.devices.values() if d.native == driver}
        if (vendor, device) in known | natives:
            raise _error(errno.EEXIST)
        known.add((vendor, device))
        for address in self.devices:
            unbound = self.driver_of(address) is None
            if unbound and self._matches(driver, address) and driver not in self.refuse_probe:
                self._bind(address, driver)

    def _store_probe(self, address: str) -> None:
        if address not in self.devices:
            raise _error(errno.ENODEV)
        if self.driver_of(address) is not None:
            return
        for driver in sorted(self.loaded):
            if self._matches(driver, address) and driver not in self.refuse_probe:
                self._bind(address, driver)
                return
        # like the kernel: drivers_probe succeeds whether a driver took the device or not

    def _matches(self, driver: str, address: str) -> bool:
        """pci_match_device: the override decides alone; else the id table, then new_id's."""
        device = self.devices[address]
        override = (self.device_dir(address) / "driver_override").read_text().strip()
        if override not in ("", "(null)"):
            return override == driver
        ids = self.dynamic_ids.get(driver, set())
        return driver == device.native or (device.vendor, device.device) in ids

    def _real_devices(self) -> Path:
        return (self.sys / "devices" / "pci0000:00").resolve()

    def _drivers(self) -> Path:
        return (self.sys / "bus/pci/drivers").resolve()

    def _bus(self) -> Path:
        return (self.sys / "bus/pci").resolve()

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
        if driver == device.native and device.framebuffer:
            # The driver registers its framebuffer, and a bound fbcon takes it over.
            (real / "graphics" / device.framebuffer).mkdir(parents=True, exist_ok=True)
            (real / "graphics" / device.framebuffer / "device").symlink_to("../..")
            (self.sys / "class/graphics").mkdir(parents=True, exist_ok=True)
            link = self.sys / "class/graphics" / device.framebuffer
            link.symlink_to(real / "graphics" / device.framebuffer)

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
            if device.framebuffer:
                (self.sys / "class/graphics" / device.framebuffer).unlink()
                (real / "graphics" / device.framebuffer / "device").unlink()
                (real / "graphics" / device.framebuffer).rmdir()


def _device_name(text: str) -> str:
    """What bus_find_device_by_name compares: the text without one trailing newline."""
    return text[:-1] if text.endswith("\n") else text


def _error(code: int, path: Path | None = None) -> OSError:
    if path is None:
        return OSError(code, os.strerror(code))
    return OSError(code, os.strerror(code), str(path))


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


class FakeProc:
    """/proc for a test: the real entries of the processes it names (symlinks to
    /proc/PID, so their fds, stat and exe are the kernel's own), the boot id, and
    the files the nvidia driver adds under /proc/driver/nvidia, which exist only
    where that driver runs (`gpus/ADDRESS/information` with its "Device Minor")."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "sys/kernel/random").mkdir(parents=True, exist_ok=True)
        (root / "sys/kernel/random/boot_id").write_text("6f0c1f5e-0000-4000-8000-000000000001\n")
        self.show(os.getpid())

    def show(self, pid: int) -> None:
        link = self.root / str(pid)
        if not link.exists():
            link.symlink_to(f"/proc/{pid}")

    def nvidia_gpu(self, address: str, minor: int) -> None:
        directory = self.root / "driver/nvidia/gpus" / address
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "information").write_text(
            f"Model: \t\t NVIDIA GeForce RTX 4090\nIRQ:   \t\t 160\nDevice Minor: \t {minor}\n"
        )
