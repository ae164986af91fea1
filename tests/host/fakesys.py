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

SR-IOV (drivers/pci/iov.c, what tests/kernel/test_sriov_kernel.py saw Linux 6.1 do):
a device with `sriov` is a physical function with `sriov_totalvfs`, `sriov_numvfs`,
`sriov_offset`, `sriov_stride`, `sriov_vf_device` and `sriov_drivers_autoprobe`;

- writing N to `sriov_numvfs` creates N virtual functions at the routing ids the
  offset and stride give, each with a `physfn` link, a `virtfnI` link on the PF,
  and an IOMMU group of its own (the lowest free number, as the kernel's ida
  gives); their vendor id in configuration space reads 0xffff (the SR-IOV
  specification; QEMU's VFs do the same).  Text that is not a number: EINVAL;
  more than `sriov_totalvfs`: ERANGE; the count it has already: nothing; no
  driver on the PF: ENOENT; another count while VFs exist: EBUSY (the kernel
  wants 0 first);
- a VF is probed only with its PF's `sriov_drivers_autoprobe` on, or with a
  `driver_override` (pci_device_can_probe); new VFs go to their native driver
  when autoprobe is on;
- writing 0 removes them in index order, each as the kernel does: its `virtfnI`
  and `physfn` links, then its driver (links, /dev/vfio/N), then the device and
  its group.  A VF whose VFIO device a process holds (`hold_vfio_device`, a real
  process) blocks the write there until that process is gone, and while it
  blocks a read of `sriov_numvfs` blocks too (the kernel's device lock: here
  the file becomes a pipe with no data); an unbind of vfio-pci from that VF
  blocks the same way.  A process that holds only the group file blocks nothing;
- vfio-pci refuses a physical function whose VFs exist (EBUSY; silently for
  `drivers_probe`), and unbinding a PF's driver leaves its VFs in place.

The SR-IOV state lives in the tree only, so a write made in a helper process
(`blocking.ChildWriter`) is seen by this one.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from charly_arbiter.core.pci import vf_address


@dataclass
class FakeSriov:
    """A physical function's SR-IOV capability."""

    total_vfs: int
    vf_device: str  # the VFs' device id
    vf_native: str | None = None  # the driver new VFs go to with autoprobe on
    offset: int = 1
    stride: int = 1
    # NVIDIA vGPU (software 17 and later, no mdev): the types the GPU supports; each VF
    # on nvidia then has nvidia/creatable_vgpu_types and nvidia/current_vgpu_type.
    vgpu_types: dict[int, str] = field(default_factory=dict)


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
    sriov: FakeSriov | None = None  # a physical function
    physfn: str | None = None  # a virtual function (made by a write of sriov_numvfs)


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
            for address in self.present():
                if self.driver_of(address) is None and self._matches(driver, address):
                    self._bind(address, driver)

    def unload(self, driver: str) -> None:
        """Like rmmod: the driver lets go of its devices, then its directory goes."""
        for address in self.present():
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
        self._create(device)
        if device.native in self.loaded:
            self._bind(device.address, device.native)

    def _create(self, device: FakeDevice) -> None:
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
        if device.physfn is not None:
            config = b"\xff" * 4  # a VF's vendor and device id registers (SR-IOV 3.4.1.1)
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
        if device.sriov is not None:
            sriov = device.sriov
            for name, value in (
                ("sriov_totalvfs", sriov.total_vfs),
                ("sriov_numvfs", 0),
                ("sriov_offset", sriov.offset),
                ("sriov_stride", sriov.stride),
                ("sriov_vf_device", sriov.vf_device),
                ("sriov_drivers_autoprobe", 1),
            ):
                (real / name).write_text(f"{value}\n")
        if device.physfn is not None:
            os.symlink(f"../{device.physfn}", real / "physfn")

    def device_dir(self, address: str) -> Path:
        return self.sys / "bus/pci/devices" / address

    def driver_of(self, address: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self.device_dir(address) / "driver"))
        except OSError:
            return None

    def drivers(self) -> dict[str, str | None]:
        return {address: self.driver_of(address) for address in self.present()}

    def present(self) -> dict[str, FakeDevice]:
        """Every device there is now: those added, and the VFs the tree has."""
        found = dict(self.devices)
        for pf in self.devices.values():
            for index in range(pf.sriov.total_vfs if pf.sriov else 0):
                vf = self.vf_address(pf.address, index)
                if self.device_dir(vf).is_symlink():
                    found[vf] = self._vf(pf, index)
        return found

    def vf_address(self, pf: str, index: int) -> str:
        sriov = self.devices[pf].sriov
        assert sriov is not None
        return vf_address(pf, index, sriov.offset, sriov.stride)

    def _vf(self, pf: FakeDevice, index: int) -> FakeDevice:
        assert pf.sriov is not None
        address = self.vf_address(pf.address, index)
        try:
            group: str | None = os.path.basename(
                os.readlink(self.device_dir(address) / "iommu_group")
            )
        except OSError:
            group = None
        return FakeDevice(
            address,
            pf.vendor,
            pf.sriov.vf_device,
            pf.pci_class,
            pf.sriov.vf_native,
            group,
            reset_method="flr",
            physfn=pf.address,
        )

    def vfs(self, pf: str) -> list[str]:
        """The VFs of `pf` whose devices exist now (whatever links are left)."""
        return [a for a, d in self.present().items() if d.physfn == pf]

    def hold_vfio_device(self, address: str, pid: int) -> None:
        """Process `pid` holds this VF's VFIO device fd, as QEMU does (the group set
        to a container, the IOMMU type set, the device fd got).  Kept in the tree
        (a helper process makes the writes) and ended by the process's exit."""
        if self.driver_of(address) != "vfio-pci":
            raise AssertionError(f"{address} is not on vfio-pci: no VFIO device to hold")
        held = self.root / "vfio-held"
        held.mkdir(exist_ok=True)
        (held / address).write_text(str(pid))

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
        elif owner.name == "nvidia" and attribute == "current_vgpu_type":
            self._store_vgpu_type(owner.parent.name, path, text)
        elif owner.parent == self._real_devices() and attribute == "sriov_numvfs":
            self._store_numvfs(owner.name, text)
        elif owner.parent == self._real_devices() and attribute == "sriov_drivers_autoprobe":
            value = {"1": "1", "y": "1", "on": "1", "0": "0", "n": "0", "off": "0"}
            if text.strip().lower() not in value:  # kstrtobool
                raise _error(errno.EINVAL, path)
            path.write_text(value[text.strip().lower()] + "\n")
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
        if address not in self.present() or self.driver_of(address) != driver:
            raise _error(errno.ENODEV)
        if driver in self.hang_unbind:
            self.release.wait()  # blocks like nvidia's remove with a user left
        if driver == "vfio-pci" and self._vfio_holder(address) is not None:
            self._unbind_links(address, driver)  # gone before vfio_pci_remove blocks
            self._wait_for_vfio_holder(address)
            self._unbind_effects(address, driver)
            return
        self._unbind(address)

    def _store_bind(self, driver: str, address: str) -> None:
        if address not in self.present() or not self._matches(driver, address):
            raise _error(errno.ENODEV)
        if self.driver_of(address) is not None:
            raise _error(errno.EBUSY)
        if not self._can_probe(address):
            raise _error(errno.ENODEV)
        if driver in self.refuse_probe:
            raise _error(errno.ENODEV)
        if self._refuses(driver, address):
            raise _error(errno.EBUSY)
        self._bind(address, driver)

    def _refuses(self, driver: str, address: str) -> bool:
        """vfio-pci: "Cannot bind to PF with SR-IOV enabled" (vfio_pci_core), and an
        NVIDIA vGPU VF (its probe fails with EINVAL: kubevirt#17642)."""
        return driver == "vfio-pci" and (bool(self.vfs(address)) or self._vgpu_pf(address))

    # -- NVIDIA vGPU on VFs, as NVIDIA's vGPU user guide documents the files ------------

    def _vgpu_pf(self, address: str) -> FakeDevice | None:
        """The PF of `address` when it is an NVIDIA vGPU VF (its PF supports vGPU types)."""
        physfn = self.present()[address].physfn
        pf = self.devices.get(physfn or "")
        return pf if pf is not None and pf.sriov is not None and pf.sriov.vgpu_types else None

    def _vgpu_files(self, address: str) -> Path:
        return self.device_dir(address).resolve() / "nvidia"

    def vgpu_type(self, address: str) -> int:
        return int((self._vgpu_files(address) / "current_vgpu_type").read_text())

    def _render_creatable(self, pf: FakeDevice) -> None:
        """What each VF on nvidia may be given now: every type while no VF has one, then
        only the type the others have (one type at a time, unless in mixed mode), and
        nothing for a VF that has a type already."""
        assert pf.sriov is not None
        vfs = [vf for vf in self.vfs(pf.address) if self._vgpu_files(vf).is_dir()]
        taken = {self.vgpu_type(vf) for vf in vfs} - {0}
        for vf in vfs:
            types = {} if self.vgpu_type(vf) else pf.sriov.vgpu_types
            lines = ["ID    : vGPU Name"] + [
                f"{type_id:<5} : {name}"
                for type_id, name in sorted(types.items())
                if not taken or type_id in taken
            ]
            (self._vgpu_files(vf) / "creatable_vgpu_types").write_text("\n".join(lines) + "\n")

    def _store_vgpu_type(self, address: str, path: Path, text: str) -> None:
        pf = self._vgpu_pf(address)
        assert pf is not None
        try:
            wanted = int(text.strip())
        except ValueError:
            raise _error(errno.EINVAL, path) from None
        if wanted and self.vgpu_type(address):
            raise _error(errno.EBUSY, path)  # it has a vGPU: write 0 first
        creatable = (self._vgpu_files(address) / "creatable_vgpu_types").read_text()
        listed = {line.partition(":")[0].strip() for line in creatable.splitlines()[1:]}
        if wanted and str(wanted) not in listed:
            raise _error(errno.EINVAL, path)
        path.write_text(f"{wanted}\n")
        self._render_creatable(pf)

    def _can_probe(self, address: str) -> bool:
        """pci_device_can_probe: a VF only with its PF's autoprobe on, or an override."""
        physfn = self.present()[address].physfn
        if physfn is None:
            return True
        autoprobe = (self.device_dir(physfn) / "sriov_drivers_autoprobe").read_text().strip()
        override = (self.device_dir(address) / "driver_override").read_text().strip()
        return autoprobe == "1" or override not in ("", "(null)")

    # -- SR-IOV ------------------------------------------------------------------------

    def _store_numvfs(self, pf: str, text: str) -> None:
        """sriov_numvfs_store (drivers/pci/iov.c)."""
        device = self.devices.get(pf)
        if device is None or device.sriov is None:
            raise _error(errno.EACCES)  # no such attribute: the open fails
        try:
            count = int(text[:-1] if text.endswith("\n") else text, 0)  # kstrtou16
        except ValueError:
            raise _error(errno.EINVAL) from None
        if not 0 <= count < 2**16:
            raise _error(errno.EINVAL)
        if count > device.sriov.total_vfs:
            raise _error(errno.ERANGE)
        existing = self.vfs(pf)
        if count == len(existing):
            return
        if self.driver_of(pf) is None:
            raise _error(errno.ENOENT)  # "no driver bound to device; cannot configure SR-IOV"
        if count == 0:
            self._disable_sriov(device)
        elif existing:
            raise _error(errno.EBUSY)  # "%d VFs already enabled. Disable before enabling"
        else:
            self._enable_sriov(device, count)

    def _enable_sriov(self, pf: FakeDevice, count: int) -> None:
        assert pf.sriov is not None
        pf_dir = self.device_dir(pf.address).resolve()
        autoprobe = (pf_dir / "sriov_drivers_autoprobe").read_text().strip() == "1"
        for index in range(count):
            vf = self._vf(pf, index)
            vf.group = self._free_group()
            self._create(vf)
            os.symlink(f"../{vf.address}", pf_dir / f"virtfn{index}")
            if autoprobe and vf.native in self.loaded and vf.native not in self.refuse_probe:
                self._bind(vf.address, vf.native)
        (pf_dir / "sriov_numvfs").write_text(f"{count}\n")

    def _disable_sriov(self, pf: FakeDevice) -> None:
        """sriov_disable: each VF in index order (pci_iov_remove_virtfn), then num_VFs = 0."""
        pf_dir = self.device_dir(pf.address).resolve()
        numvfs = pf_dir / "sriov_numvfs"
        locked: int | None = None
        try:
            for index, vf in enumerate(self.vfs(pf.address)):
                real = self.device_dir(vf).resolve()
                (pf_dir / f"virtfn{index}").unlink(missing_ok=True)
                (real / "physfn").unlink(missing_ok=True)
                driver = self.driver_of(vf)
                if driver is not None:
                    self._unbind_links(vf, driver)
                if driver == "vfio-pci" and self._vfio_holder(vf) is not None and locked is None:
                    # The store holds the PF's device lock: readers of sriov_numvfs block.
                    numvfs.unlink()
                    os.mkfifo(numvfs)
                    locked = os.open(numvfs, os.O_RDWR | os.O_NONBLOCK)
                if driver == "vfio-pci":
                    self._wait_for_vfio_holder(vf)
                    self._unbind_effects(vf, driver)
                elif driver is not None:
                    self._unbind_effects(vf, driver)
                self._remove(vf)
        finally:
            done = pf_dir / ".sriov_numvfs"
            done.write_text("0\n")
            os.replace(done, numvfs)
            if locked is not None:
                os.write(locked, b"0\n")  # what the blocked reader gets
                os.close(locked)

    def _vfio_holder(self, address: str) -> int | None:
        try:
            pid = int((self.root / "vfio-held" / address).read_text())
        except (OSError, ValueError):
            return None
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        return None if stat[stat.rindex(")") + 2] in "ZX" else pid

    def _wait_for_vfio_holder(self, address: str) -> None:
        """vfio_unregister_group_dev: "blocked until released by user"."""
        deadline = time.monotonic() + 600  # a test that forgot its holder ends, one day
        while self._vfio_holder(address) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        (self.root / "vfio-held" / address).unlink(missing_ok=True)

    def _free_group(self) -> str:
        """The lowest free IOMMU group number (iommu_group_alloc takes it from an ida)."""
        taken = {int(p.name) for p in (self.sys / "kernel/iommu_groups").iterdir()}
        return str(min(set(range(len(taken) + 1)) - taken))

    def _remove(self, address: str) -> None:
        """pci_stop_and_remove_bus_device: the device, its bus link and its group go."""
        real = self.device_dir(address).resolve()
        group = (
            self.sys / "kernel/iommu_groups" / (os.path.basename(os.readlink(real / "iommu_group")))
        )
        (group / "devices" / address).unlink()
        if not any((group / "devices").iterdir()):
            (group / "devices").rmdir()
            group.rmdir()
        self.device_dir(address).unlink()
        for entry in real.iterdir():
            entry.unlink()
        real.rmdir()

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
        for address in self.present():
            unbound = self.driver_of(address) is None
            if unbound and self._matches(driver, address) and self._takes(driver, address):
                self._bind(address, driver)

    def _takes(self, driver: str, address: str) -> bool:
        """Whether a probe of `address` by `driver` succeeds."""
        return (
            driver not in self.refuse_probe
            and self._can_probe(address)
            and not self._refuses(driver, address)
        )

    def _store_probe(self, address: str) -> None:
        if address not in self.present():
            raise _error(errno.ENODEV)
        if self.driver_of(address) is not None:
            return
        for driver in sorted(self.loaded):
            if self._matches(driver, address) and self._takes(driver, address):
                self._bind(address, driver)
                return
        # like the kernel: drivers_probe succeeds whether a driver took the device or not

    def _matches(self, driver: str, address: str) -> bool:
        """pci_match_device: the override decides alone; else the id table, then new_id's."""
        device = self.present()[address]
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
        device = self.present()[address]
        real = self.device_dir(address).resolve()
        os.symlink(f"../../../bus/pci/drivers/{driver}", real / "driver")
        (self.sys / "bus/pci/drivers" / driver / address).symlink_to(real)
        if driver == "vfio-pci" and device.group is not None:
            (self.dev / "vfio" / device.group).touch()
        pf = self._vgpu_pf(address) if driver == "nvidia" else None
        if pf is not None:
            self._vgpu_files(address).mkdir()
            (self._vgpu_files(address) / "current_vgpu_type").write_text("0\n")
            self._render_creatable(pf)
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
        driver = self.driver_of(address)
        assert driver is not None
        self._unbind_links(address, driver)
        self._unbind_effects(address, driver)

    def _unbind_links(self, address: str, driver: str) -> None:
        """driver_sysfs_remove: the links go before the driver's remove runs."""
        real = self.device_dir(address).resolve()
        (real / "driver").unlink()
        (self.sys / "bus/pci/drivers" / driver / address).unlink()

    def _unbind_effects(self, address: str, driver: str) -> None:
        """What the driver's remove takes away: its nodes, its framebuffer."""
        devices = self.present()
        device = devices[address]
        real = self.device_dir(address).resolve()
        if driver == "nvidia" and self._vgpu_files(address).is_dir():
            for name in ("creatable_vgpu_types", "current_vgpu_type"):
                (self._vgpu_files(address) / name).unlink()
            self._vgpu_files(address).rmdir()
        if driver == "vfio-pci" and device.group is not None:
            others = [a for a, d in devices.items() if d.group == device.group and a != address]
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


@dataclass(frozen=True)
class FakeProcess:
    """A process of a fake /proc: a directory of its own (not the kernel's), with what
    the screen's reading looks at: fd links to device nodes, comm, status (Uid, PPid),
    stat (its start time), cgroup (the unified hierarchy's line), sessionid (the audit
    session: 4294967295 for none) and environ."""

    pid: int
    comm: str
    uid: int = 0
    fds: tuple[str, ...] = ()  # what each fd links to (`/dev/dri/card0`)
    cgroup: str = "/system.slice/unknown.service"
    sessionid: str | None = None  # None: 4294967295
    environ: tuple[tuple[str, str], ...] = ()
    ppid: int = 1


class FakeRun:
    """/run as systemd and logind keep it: `systemd/sessions/ID` (logind's session
    files, `KEY=VALUE` lines) and `systemd/units/invocation:UNIT` (a link to the
    unit's invocation id, which systemd also puts in its processes' INVOCATION_ID)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "systemd/sessions").mkdir(parents=True, exist_ok=True)
        (root / "systemd/units").mkdir(parents=True, exist_ok=True)

    def session(
        self,
        session_id: str,
        *,
        uid: int,
        user: str,
        leader: int,
        seat: str | None = "seat0",
        type: str = "wayland",
        klass: str = "user",
        service: str = "login",
    ) -> None:
        lines = [
            "# This is private data. Do not parse.",
            f"UID={uid}",
            f"USER={user}",
            "ACTIVE=1",
            "STATE=active",
            "REMOTE=0",
            f"TYPE={type}",
            f"ORIGINAL_TYPE={type}",
            f"CLASS={klass}",
            f"SCOPE=session-{session_id}.scope",
            f"SERVICE={service}",
            f"LEADER={leader}",
        ]
        if seat is not None:
            lines += [f"SEAT={seat}", "VTNR=7"]
        (self.root / "systemd/sessions" / session_id).write_text("\n".join(lines) + "\n")

    def unit(self, name: str, invocation: str) -> None:
        (self.root / "systemd/units" / f"invocation:{name}").symlink_to(invocation)


def add_process(proc: Path, process: FakeProcess) -> None:
    """`process` under the fake /proc root `proc`."""
    directory = proc / str(process.pid)
    (directory / "fd").mkdir(parents=True)
    for number, target in enumerate(process.fds, start=3):
        (directory / "fd" / str(number)).symlink_to(target)
    (directory / "comm").write_text(process.comm + "\n")
    (directory / "cmdline").write_bytes(process.comm.encode() + b"\0")
    (directory / "status").write_text(
        f"Name:\t{process.comm}\nPPid:\t{process.ppid}\n"
        f"Uid:\t{process.uid}\t{process.uid}\t{process.uid}\t{process.uid}\n"
    )
    (directory / "stat").write_text(
        f"{process.pid} ({process.comm}) S {process.ppid} " + " ".join(["0"] * 17) + " 4242 0\n"
    )
    (directory / "cgroup").write_text(f"0::{process.cgroup}\n")
    (directory / "sessionid").write_text(process.sessionid or "4294967295")
    (directory / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in process.environ))


def desktop(proc: Path, run: FakeRun, dev: Path, card: str = "card0") -> dict[str, FakeProcess]:
    """A display manager that opens its own session, as tests/kernel/sysguest.py's
    weston does with real systemd (issue 19's finding F1): `charly-weston.service`
    (PAMName=login, user charly-weston, uid 998) whose only process, weston, logind
    moved into session-2.scope, leaving the unit's own cgroup empty.  Its
    INVOCATION_ID is the unit's; session 2 is a wayland session on seat0 led by it.
    Besides: logind and PID 1 holding the card for the session (TakeDevice, and the
    fd store), the user's pipewire in user@998.service holding the render node, and
    a system service rendering on the GPU (none of them the screen's but pipewire)."""
    invocation = "5b1f0c8e2a7d4c33a1c0de1e9f2b7a10"
    run.unit("charly-weston.service", invocation)
    run.unit("ollama.service", "0000000000000000000000000000beef")
    run.session("2", uid=998, user="charly-weston", leader=612)
    card_fd = str(dev / "dri" / card)
    processes = {
        "systemd": FakeProcess(1, "systemd", fds=(card_fd,), cgroup="/init.scope", ppid=0),
        "logind": FakeProcess(
            310, "systemd-logind", fds=(card_fd,), cgroup="/system.slice/systemd-logind.service"
        ),
        "weston": FakeProcess(
            612,
            "weston",
            uid=998,
            fds=(str(dev / "dri" / card), str(dev / "dri/renderD128")),
            cgroup="/user.slice/user-998.slice/session-2.scope",
            sessionid="2",
            environ=(("INVOCATION_ID", invocation), ("XDG_SESSION_TYPE", "wayland")),
        ),
        "pipewire": FakeProcess(
            700,
            "pipewire",
            uid=998,
            fds=(str(dev / "dri/renderD128"),),
            cgroup="/user.slice/user-998.slice/user@998.service/session.slice/pipewire.service",
            ppid=690,
        ),
        "ollama": FakeProcess(
            800,
            "ollama",
            uid=997,
            fds=(str(dev / "dri/renderD128"),),
            cgroup="/system.slice/ollama.service",
            environ=(("INVOCATION_ID", "0000000000000000000000000000beef"),),
        ),
    }
    for process in processes.values():
        add_process(proc, process)
    return processes


def gpu_with_vfs(root: Path) -> FakeKernel:
    """A GPU that can have two virtual functions (as Intel's Flex, AMD's MxGPU or an
    NVIDIA data-centre GPU can have more): the PF at 0000:03:00.0 on i915 (group 20),
    whose VFs would be 03:00.1 and 03:00.2 and go to i915 too when autoprobe is on;
    and a plain GPU at 0000:0b:00.0 (group 13) beside it."""
    kernel = FakeKernel(root, loaded={"vfio-pci", "i915"})
    sriov = FakeSriov(total_vfs=2, vf_device="56c1", vf_native="i915")
    kernel.add(FakeDevice("0000:03:00.0", "8086", "56c0", "038000", "i915", "20", sriov=sriov))
    kernel.add(FakeDevice("0000:0b:00.0", "8086", "a780", "030000", "i915", "13", drm=("card0",)))
    return kernel


def nvidia_with_vgpu_vfs(root: Path) -> FakeKernel:
    """An NVIDIA GPU with SR-IOV whose VFs serve vGPU (an L40S as NVIDIA's vGPU 17+
    drives it: no mdev, the VFs come up on nvidia and get a type through
    nvidia/current_vgpu_type): the PF at 0000:41:00.0 (group 30), up to 4 VFs from
    41:00.4 (offset 4, as NVIDIA's PFs place them), vGPU types 1-Q, 2-Q and 4-Q."""
    kernel = FakeKernel(root, loaded={"vfio-pci", "nvidia"})
    types = {557: "NVIDIA L40S-1Q", 558: "NVIDIA L40S-2Q", 560: "NVIDIA L40S-4Q"}
    sriov = FakeSriov(4, "26b9", vf_native="nvidia", offset=4, vgpu_types=types)
    kernel.add(FakeDevice("0000:41:00.0", "10de", "26b9", "030200", "nvidia", "30", sriov=sriov))
    return kernel
