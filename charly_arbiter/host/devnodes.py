"""Character device numbers to PCI functions: which GPU a container is given.

A container's OCI spec lists its devices by (major, minor), not by path, so the
OCI hook asks this module what each number is.  The kernel answers for most
nodes: `/sys/dev/char/MAJOR:MINOR` links to the device, under its PCI function
for a DRM card or render node.  NVIDIA's `/dev/nvidiaN` has no sysfs device;
its minor is the driver's "Device Minor" of one GPU (/proc/driver/nvidia).

A node whose function the kernel cannot name now is still known to be a GPU's
by its major (`/proc/devices` names `drm` and `nvidia`): that happens when its
GPU is not bound to the driver, on vfio-pci for a VM perhaps, and the caller
must then not take it for "no GPU".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from charly_arbiter.core.host import UNKNOWN_FUNCTION
from charly_arbiter.core.pci import is_address
from charly_arbiter.host.pcidata import nvidia_minor
from charly_arbiter.host.procscan import DeviceNumber

# /proc/devices names of the drivers whose nodes belong to one GPU each.
GPU_MAJORS = {"drm": "drm", "nvidia": "nvidia", "nvidia-frontend": "nvidia"}
NVIDIA_CONTROL_MINORS = (254, 255)  # nvidia-modeset and nvidiactl: every GPU's, no one's


def gpu_majors(proc_root: Path) -> dict[int, str]:
    """Character majors of the GPU drivers loaded now: major -> "drm" or "nvidia"."""
    try:
        text = (proc_root / "devices").read_text()
    except OSError:
        return {}
    majors: dict[int, str] = {}
    characters = text.partition("Block devices:")[0]
    for line in characters.splitlines():
        number, _, name = line.strip().partition(" ")
        if number.isdigit() and name.strip() in GPU_MAJORS:
            majors[int(number)] = GPU_MAJORS[name.strip()]
    return majors


def sysfs_function(sys_root: Path, number: DeviceNumber) -> str | None:
    """The PCI function a character device hangs under in sysfs, or None."""
    link = sys_root / "dev" / "char" / f"{number[0]}:{number[1]}"
    try:
        target = os.path.realpath(link, strict=True)
    except OSError:
        return None
    addresses = [part for part in Path(target).parts if is_address(part)]
    return addresses[-1] if addresses else None


def device_functions(
    sys_root: Path, proc_root: Path, numbers: Sequence[DeviceNumber]
) -> dict[DeviceNumber, str]:
    """See `Host.device_functions`: each number's function, UNKNOWN_FUNCTION for a GPU
    driver's node of no function bound now, and nothing for other devices."""
    majors: dict[int, str] | None = None
    nvidia: dict[str, str] | None = None
    found: dict[DeviceNumber, str] = {}
    for number in dict.fromkeys(numbers):
        address = sysfs_function(sys_root, number)
        if address is not None:
            found[number] = address
            continue
        if majors is None:
            majors = gpu_majors(proc_root)
        driver = majors.get(number[0])
        if driver == "drm":
            found[number] = UNKNOWN_FUNCTION
        elif driver == "nvidia" and number[1] not in NVIDIA_CONTROL_MINORS:
            if nvidia is None:
                nvidia = _nvidia_minors(proc_root)
            found[number] = nvidia.get(str(number[1]), UNKNOWN_FUNCTION)
    return found


def _nvidia_minors(proc_root: Path) -> dict[str, str]:
    """NVIDIA device minor -> PCI address, for every GPU the nvidia driver has now."""
    gpus = proc_root / "driver" / "nvidia" / "gpus"
    try:
        addresses = sorted(entry.name for entry in gpus.iterdir())
    except OSError:
        return {}
    minors = {}
    for address in addresses:
        minor = nvidia_minor(proc_root, address)
        if minor is not None:
            minors[minor] = address
    return minors
