"""Character device numbers to PCI functions (host/devnodes.py), on fake trees.

The trees have the real layout: /sys/dev/char/MAJOR:MINOR links into
/sys/devices (under the PCI function for a DRM node, under devices/virtual for
a misc device), /proc/devices lists majors by driver name, and NVIDIA's driver
names each GPU's minor in /proc/driver/nvidia/gpus/ADDRESS/information.
"""

from __future__ import annotations

from pathlib import Path

from charly_arbiter.core.host import UNKNOWN_FUNCTION
from charly_arbiter.host.devnodes import device_functions, gpu_majors

PROC_DEVICES = """Character devices:
  1 mem
 10 misc
195 nvidia-frontend
226 drm
237 nvidia-uvm

Block devices:
  7 loop
226 notachardev
"""


def trees(tmp_path: Path) -> tuple[Path, Path]:
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    chars = sys_root / "dev" / "char"
    chars.mkdir(parents=True)
    bridge = sys_root / "devices" / "pci0000:00" / "0000:00:01.0"
    for name, number in (("card1", "226:1"), ("renderD129", "226:129")):
        node = bridge / "0000:0a:00.0" / "drm" / name
        node.mkdir(parents=True)
        (chars / number).symlink_to(node)
    fuse = sys_root / "devices" / "virtual" / "misc" / "fuse"
    fuse.mkdir(parents=True)
    (chars / "10:229").symlink_to(fuse)
    proc_root.mkdir()
    (proc_root / "devices").write_text(PROC_DEVICES)
    gpu = proc_root / "driver" / "nvidia" / "gpus" / "0000:0b:00.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text("Model: \t\t NVIDIA\nDevice Minor: \t 0\nBus Type: PCIe\n")
    return sys_root, proc_root


def test_majors_are_read_from_the_character_devices_only(tmp_path: Path) -> None:
    _, proc_root = trees(tmp_path)
    assert gpu_majors(proc_root) == {195: "nvidia", 226: "drm"}


def test_each_number_is_named_by_its_function_or_known_as_a_gpu_node(tmp_path: Path) -> None:
    sys_root, proc_root = trees(tmp_path)
    numbers = [(226, 1), (226, 129), (10, 229), (195, 0), (195, 1), (195, 255), (226, 5), (7, 0)]
    assert device_functions(sys_root, proc_root, numbers) == {
        (226, 1): "0000:0a:00.0",  # a DRM card, by its sysfs link
        (226, 129): "0000:0a:00.0",  # its render node
        (195, 0): "0000:0b:00.0",  # /dev/nvidia0, by the driver's Device Minor
        (195, 1): UNKNOWN_FUNCTION,  # /dev/nvidia1 of no GPU on nvidia now (vfio-pci?)
        (226, 5): UNKNOWN_FUNCTION,  # a DRM node whose device is gone
    }  # fuse, nvidiactl (195:255) and a block major are no GPU's nodes


def test_without_gpu_drivers_nothing_is_a_gpu_node(tmp_path: Path) -> None:
    sys_root, proc_root = trees(tmp_path)
    (proc_root / "devices").write_text("Character devices:\n 10 misc\n\nBlock devices:\n")
    assert device_functions(sys_root, proc_root, [(226, 5), (195, 0)]) == {}
