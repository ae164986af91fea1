"""The fake kernel refuses what the kernel refuses (drivers/base/bus.c, pci-driver.c).

A fake that accepts a write the kernel rejects lets a bug in the sysfs layer
pass every test; these pin each refusal, and one is checked against this
machine's real /sys without changing anything there.
"""

from __future__ import annotations

import errno
import glob
import os
from pathlib import Path

import pytest
from fakesys import FakeKernel

GPU = "0000:0a:00.0"
AUDIO = "0000:0a:00.1"
IGPU = "0000:0b:00.0"  # i915 is not loaded: no driver
UNKNOWN = "0000:0e:00.0"


def errno_of(kernel: FakeKernel, relative: str, text: str) -> int:
    with pytest.raises(OSError) as error:
        kernel.write(kernel.sys / relative, text)
    assert error.value.errno is not None
    return error.value.errno


def test_unbind_through_a_driver_the_device_is_not_bound_to_is_enodev(kernel: FakeKernel) -> None:
    assert errno_of(kernel, "bus/pci/drivers/vfio-pci/unbind", GPU) == errno.ENODEV
    assert errno_of(kernel, "bus/pci/drivers/nvidia/unbind", AUDIO) == errno.ENODEV
    assert errno_of(kernel, "bus/pci/drivers/nvidia/unbind", UNKNOWN) == errno.ENODEV
    assert kernel.drivers()[GPU] == "nvidia" and kernel.drivers()[AUDIO] == "snd_hda_intel"


def test_unbind_through_the_driver_link_of_an_unbound_device_cannot_even_open(
    kernel: FakeKernel,
) -> None:
    assert errno_of(kernel, f"bus/pci/devices/{IGPU}/driver/unbind", IGPU) == errno.ENOENT


def test_unbind_takes_the_name_with_or_without_a_newline(kernel: FakeKernel) -> None:
    kernel.write(kernel.sys / "bus/pci/drivers/nvidia/unbind", f"{GPU}\n")
    assert kernel.driver_of(GPU) is None
    assert not (kernel.dev / "dri" / "card1").exists()


def test_drivers_probe_of_an_unknown_device_is_enodev(kernel: FakeKernel) -> None:
    assert errno_of(kernel, "bus/pci/drivers_probe", UNKNOWN) == errno.ENODEV


def test_drivers_probe_of_a_bound_device_changes_nothing(kernel: FakeKernel) -> None:
    kernel.write(kernel.device_dir(GPU) / "driver_override", "vfio-pci\n")
    kernel.write(kernel.sys / "bus/pci/drivers_probe", GPU)
    assert kernel.driver_of(GPU) == "nvidia"


def test_drivers_probe_that_finds_no_driver_succeeds_silently(kernel: FakeKernel) -> None:
    kernel.write(kernel.sys / "bus/pci/drivers_probe", IGPU)
    assert kernel.driver_of(IGPU) is None


def test_bind_refuses_a_bound_device_a_foreign_one_and_an_unknown_one(kernel: FakeKernel) -> None:
    assert errno_of(kernel, "bus/pci/drivers/nvidia/bind", GPU) == errno.EBUSY
    assert errno_of(kernel, "bus/pci/drivers/nvidia/bind", IGPU) == errno.ENODEV
    assert errno_of(kernel, "bus/pci/drivers/nvidia/bind", UNKNOWN) == errno.ENODEV


def test_vfio_pci_binds_only_with_the_override(kernel: FakeKernel) -> None:
    kernel.write(kernel.sys / "bus/pci/drivers/nvidia/unbind", GPU)
    assert errno_of(kernel, "bus/pci/drivers/vfio-pci/bind", GPU) == errno.ENODEV
    kernel.write(kernel.device_dir(GPU) / "driver_override", "vfio-pci\n")
    assert errno_of(kernel, "bus/pci/drivers/nvidia/bind", GPU) == errno.ENODEV
    kernel.write(kernel.sys / "bus/pci/drivers/vfio-pci/bind", GPU)
    assert kernel.driver_of(GPU) == "vfio-pci" and (kernel.dev / "vfio" / "12").exists()


def test_bind_with_a_refusing_probe_fails(kernel: FakeKernel) -> None:
    kernel.write(kernel.sys / "bus/pci/drivers/nvidia/unbind", GPU)
    kernel.refuse_probe.add("nvidia")
    assert errno_of(kernel, "bus/pci/drivers/nvidia/bind", GPU) == errno.ENODEV
    assert kernel.driver_of(GPU) is None


def test_new_id_checks_its_input_and_binds_what_now_matches(kernel: FakeKernel) -> None:
    new_id = "bus/pci/drivers/vfio-pci/new_id"
    assert errno_of(kernel, new_id, "8086") == errno.EINVAL
    assert errno_of(kernel, new_id, "8086 zz") == errno.EINVAL
    assert errno_of(kernel, "bus/pci/drivers/nvidia/new_id", "10de 2684") == errno.EEXIST
    kernel.write(kernel.sys / new_id, "8086 a780\n")
    assert kernel.driver_of(IGPU) == "vfio-pci"
    assert errno_of(kernel, new_id, "8086 a780") == errno.EEXIST


@pytest.mark.parametrize(
    "attribute", ["vendor", "device", "class", "boot_vga"], ids=lambda name: name
)
def test_read_only_attributes_cannot_be_opened_for_writing(
    kernel: FakeKernel, attribute: str
) -> None:
    path = kernel.device_dir(IGPU) / attribute
    before = path.read_text()
    assert errno_of(kernel, f"bus/pci/devices/{IGPU}/{attribute}", "0x10de\n") == errno.EACCES
    assert path.read_text() == before


def test_missing_attributes_and_directories_are_not_written(kernel: FakeKernel) -> None:
    assert errno_of(kernel, f"bus/pci/devices/{GPU}/reset", "1") == errno.ENOENT
    assert not (kernel.device_dir(GPU) / "reset").exists()
    assert errno_of(kernel, f"bus/pci/devices/{GPU}/driver", "x") == errno.EISDIR


def test_driver_override_keeps_the_first_line_and_an_empty_one_clears_it(
    kernel: FakeKernel,
) -> None:
    override = kernel.device_dir(GPU) / "driver_override"
    kernel.write(override, "vfio-pci\n")
    assert override.read_text() == "vfio-pci\n"
    kernel.write(override, "\n")
    assert override.read_text() == "(null)\n"
    assert errno_of(kernel, f"bus/pci/devices/{GPU}/driver_override", "x" * 4096) == errno.EINVAL


def test_failed_writes_are_recorded_too(kernel: FakeKernel) -> None:
    errno_of(kernel, "bus/pci/drivers/vfio-pci/unbind", GPU)
    assert kernel.writes == [("bus/pci/drivers/vfio-pci/unbind", GPU)]


def test_unloading_a_driver_unbinds_its_devices_first(kernel: FakeKernel) -> None:
    kernel.unload("nvidia")
    assert kernel.driver_of(GPU) is None
    assert not (kernel.device_dir(GPU) / "driver").is_symlink()
    assert not (kernel.dev / "dri" / "card1").exists()
    assert not (kernel.sys / "bus/pci/drivers/nvidia").exists()


def test_the_real_sysfs_refuses_to_open_a_read_only_attribute_even_for_root(
    kernel: FakeKernel,
) -> None:
    """What the fake's EACCES is based on, seen on this machine: open(2) fails, so
    nothing is ever written (should it succeed, the file is closed unwritten)."""
    if os.geteuid() != 0:
        pytest.skip("the point is that root is refused too")
    attributes = sorted(glob.glob("/sys/bus/pci/devices/*/vendor"))
    if not attributes:
        pytest.skip("this machine has no PCI devices in /sys")
    real = Path(attributes[0])
    assert real.stat().st_mode & 0o777 == 0o444
    try:
        fd = os.open(real, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as error:
        real_errno = error.errno
    else:
        os.close(fd)
        pytest.fail(f"{real} opened for writing")
    assert real_errno == errno.EACCES
    assert errno_of(kernel, f"bus/pci/devices/{IGPU}/vendor", "0x10de\n") == real_errno
