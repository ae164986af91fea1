"""Boot a real Debian kernel under QEMU/TCG with this machine's root shared over 9p.

The guest is a q35 machine with an emulated Intel IOMMU and a display-class
device with a companion function in the same slot (`bochs-display` at 02.0,
`ich9-intel-hda` at 02.1): the shape of a GPU with its HDMI audio, one IOMMU
group, bound to `bochs-drm` and `snd_hda_intel`.  A busybox initramfs loads
the 9p modules, mounts the host's root read-only, a writable results share,
and runs `run.sh` from that share inside a chroot of the host's root, so the
code under test is this checkout run by the host's own /usr/bin/python3.

The root and the checkout are mounted with `cache=loose`, as sysguest.py's are:
neither changes while a guest runs (scripts/test's services write only in a
private root), and without the cache every file the guest opens is a round trip
through TCG: a guest that runs `python3 -c pass` ten times and stats a path
100,000 times took 58 s from QEMU's start to its power-off, and 16 s with it.

The kernel and busybox come from Debian's archive (`apt-get download`), are
unpacked once and cached under CACHE (override with
CHARLY_ARBITER_TEST_CACHE), so later runs boot in seconds.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("CHARLY_ARBITER_TEST_CACHE", "/var/cache/charly-arbiter-tests"))
QEMU = "/usr/bin/qemu-system-x86_64"
# The modules the initramfs needs to mount a virtio 9p share; their
# dependencies (and their order) come from the kernel's modules.dep.
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p")
# What the guest loads from the unpacked kernel package once the host root is mounted.
GUEST_MODULES = ("bochs", "snd-hda-intel", "vfio-pci", "vfio_iommu_type1")
# `boot(..., devices=SRIOV_NVME)`: QEMU's emulated NVMe controller with SR-IOV, behind a
# PCIe root port (SR-IOV needs a PCIe device), standing in for a GPU's physical function:
# 0000:01:00.0, up to two virtual functions (01:00.1, 01:00.2), driver `nvme` (module
# `nvme`, loaded by the scenario).  QEMU 7.2 wants a subsystem for SR-IOV, and
# sriov_vq_flexible >= 2 * sriov_max_vfs, sriov_vi_flexible >= sriov_max_vfs.
SRIOV_NVME = (
    "-device",
    "pcie-root-port,id=rp1,bus=pcie.0,chassis=1,slot=1,addr=03.0",
    "-device",
    "nvme-subsys,id=nvmesubsys0,nqn=charly-sriov",
    "-device",
    "nvme,serial=charly0,bus=rp1,subsys=nvmesubsys0,"
    "sriov_max_vfs=2,sriov_vq_flexible=4,sriov_vi_flexible=2",
)

# The 9p mount options every share of every guest here uses (sysguest.py too).
P9 = "trans=virtio,version=9p2000.L,msize=512000"
# The guests' kernel command line (sysguest.py adds `rw`).  no_timer_check: under TCG
# on a loaded machine the kernel's check that the timer interrupt arrives can fail,
# and with interrupt remapping it panics at boot ("timer doesn't work through
# Interrupt-remapped IO-APIC"; seen in CI).  mitigations=off: the guest runs nothing
# untrusted, and its retpolines cost TCG 5-10% (measured: ten `python3 -c pass` and
# 100,000 stats).
KERNEL_COMMAND_LINE = (
    "console=ttyS0 intel_iommu=on iommu=pt no_timer_check mitigations=off "
    "quiet panic=-1 rdinit=/init"
)

INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for module in $(cat /modules.order); do
    insmod /modules/$module || echo "insmod $module failed"
done
P9={P9}
mount -t 9p -o $P9,ro,cache=loose hostroot /mnt || poweroff -f
mount -t proc proc /mnt/proc
mount -t sysfs sys /mnt/sys
mount -t devtmpfs dev /mnt/dev
mount -t tmpfs tmp /mnt/run
mount -t tmpfs tmp /mnt/tmp
mkdir -p /mnt/run/results
mount -t 9p -o $P9 results /mnt/run/results
echo "guest: running run.sh"
chroot /mnt /bin/sh /run/results/run.sh > /mnt/run/results/console.log 2>&1
echo "guest: run.sh exited $?"
sync
poweroff -f
"""


def repo_mount_script(repo: Path) -> str:
    """Guest shell lines that make `repo` visible at its host path (see `boot`)."""
    path = shlex.quote(str(repo))
    return (
        f"if [ ! -d {path}/charly_arbiter ]; then\n"
        f"    mkdir -p {path} && mount -t 9p -o {P9},ro,cache=loose"
        f" repo {path} || echo 'guest: cannot mount the checkout' >&2\n"
        "fi\n"
    )


class QemuUnavailable(Exception):
    """QEMU cannot run on this machine at all (the only reason to skip)."""


@dataclass(frozen=True)
class Kernel:
    version: str
    root: Path  # the unpacked linux-image package (lib/modules/VERSION, boot/vmlinuz-VERSION)
    vmlinuz: Path
    initramfs: Path


@dataclass(frozen=True)
class Boot:
    seconds: float
    serial: str
    returncode: int


def _run(argv: list[str], cwd: Path | None = None) -> str:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def check_qemu() -> None:
    if not os.access(QEMU, os.X_OK):
        raise QemuUnavailable(f"{QEMU} is not installed (scripts/setup installs qemu-system-x86)")
    probe = subprocess.run([QEMU, "-version"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        raise QemuUnavailable(f"{QEMU} -version failed: {probe.stderr.strip()}")


def _newest_kernel_package() -> str | None:
    """The current bookworm ABI's unsigned amd64 image, as apt knows it.

    A machine whose package lists were cleaned (container images) knows none:
    the lists are fetched once then.
    """
    for attempt in range(2):
        try:
            listing = _run(["/usr/bin/apt-cache", "search", "--names-only", "linux-image-6.1.0-"])
        except (RuntimeError, OSError):
            listing = ""
        names = re.findall(r"^(linux-image-6\.1\.0-(\d+)-amd64-unsigned) ", listing, re.M)
        if names:
            return max(names, key=lambda item: int(item[1]))[0]
        if attempt == 0 and not list((CACHE / "debs").glob("linux-image-*.deb")):
            try:
                _run(["/usr/bin/apt-get", "update", "-qq"])
            except (RuntimeError, OSError):
                return None
    return None


def _download(package: str, debs: Path) -> Path:
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        _run(["/usr/bin/apt-get", "download", "-q", package], cwd=debs)
        found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        raise RuntimeError(f"apt-get download {package} left no .deb in {debs}")
    return found[-1]


def prepare_kernel() -> Kernel:
    """Download (once), unpack (once) and build the initramfs (once) for the newest ABI.

    Under a lock in the cache: scripts/test runs the guests in two processes at once,
    and both would otherwise download and unpack into the same place."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".kernel.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepare_kernel()


def _prepare_kernel() -> Kernel:
    debs = CACHE / "debs"
    package = _newest_kernel_package()
    if package is None:  # apt has no lists: use what an earlier run cached
        cached = sorted(debs.glob("linux-image-6.1.0-*-amd64-unsigned_*.deb"))
        if not cached:
            raise RuntimeError("apt-cache knows no linux-image-6.1.0-*-amd64-unsigned package")
        package = cached[-1].name.split("_")[0]
    version = package.removeprefix("linux-image-").removesuffix("-unsigned")
    root = CACHE / f"root-{version}"
    if not (root / "lib" / "modules" / version / "modules.dep").exists():
        deb = _download(package, debs)
        staging = CACHE / f"root-{version}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        _run(["/usr/bin/dpkg-deb", "-x", str(deb), str(staging)])
        _run(["/usr/sbin/depmod", "-b", str(staging), version])
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    initramfs = cached_initramfs(root, version, "initramfs", INIT, INITRAMFS_MODULES)
    return Kernel(version, root, root / "boot" / f"vmlinuz-{version}", initramfs)


def cached_initramfs(
    root: Path,
    version: str,
    name: str,
    init: str,
    modules: tuple[str, ...],
    directories: tuple[str, ...] = ("mnt",),
) -> Path:
    """`build_initramfs`'s initramfs in the cache, built once and named by a hash of
    its init and modules, so a changed init is never booted from an older cache (the
    older one is removed when the new one is built)."""
    digest = hashlib.sha256((init + " ".join(modules)).encode()).hexdigest()[:12]
    target = CACHE / f"{name}-{version}-{digest}.cpio.gz"
    if not target.exists():
        for stale in CACHE.glob(f"{name}-{version}-*.cpio.gz"):
            stale.unlink(missing_ok=True)
        busybox = _download("busybox-static", CACHE / "debs")
        build_initramfs(root, version, busybox, target, init, modules, directories)
    return target


def _module_order(modules_dir: Path, wanted: tuple[str, ...]) -> list[str]:
    """Module paths (relative to modules_dir) for `wanted` and their deps, deps first."""
    deps: dict[str, list[str]] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        path, _, needs = line.partition(":")
        deps[path] = needs.split()
    by_name = {Path(path).name.removesuffix(".ko"): path for path in deps}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in reversed(deps[path]):
            visit(dep)
        order.append(path)

    for name in wanted:
        visit(by_name[name])
    return order


def build_initramfs(
    root: Path,
    version: str,
    busybox_deb: Path,
    target: Path,
    init: str,
    modules: tuple[str, ...],
    directories: tuple[str, ...] = ("mnt",),
) -> None:
    """A busybox initramfs at `target` (replaced in one step): `init`, the modules
    named (their dependencies first, listed in /modules.order) and `directories`."""
    modules_dir = root / "lib" / "modules" / version
    work = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.rmtree(work, ignore_errors=True)
    for name in ("bin", "proc", "sys", "dev", "modules", *directories):
        (work / name).mkdir(parents=True)
    unpacked = work.with_name(f"{work.name}.busybox")
    shutil.rmtree(unpacked, ignore_errors=True)
    _run(["/usr/bin/dpkg-deb", "-x", str(busybox_deb), str(unpacked)])
    shutil.copy2(unpacked / "bin" / "busybox", work / "bin" / "busybox")
    shutil.rmtree(unpacked)
    order = _module_order(modules_dir, modules)
    for path in order:
        shutil.copy2(modules_dir / path, work / "modules" / Path(path).name)
    (work / "modules.order").write_text("\n".join(Path(p).name for p in order) + "\n")
    (work / "init").write_text(init)
    (work / "init").chmod(0o755)
    files = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    packed = subprocess.run(
        ["/usr/bin/cpio", "-o", "-H", "newc", "--quiet"],
        cwd=work,
        input="\n".join(files).encode(),
        capture_output=True,
        timeout=120,
        check=True,
    ).stdout
    partial = work.with_suffix(".cpio")
    partial.write_bytes(gzip.compress(packed, compresslevel=1))
    partial.rename(target)
    shutil.rmtree(work)


def boot(
    kernel: Kernel,
    results: Path,
    script: str,
    timeout: float = 300,
    repo: Path | None = None,
    devices: tuple[str, ...] = (),
) -> Boot:
    """Run `script` (sh) inside the guest with `results` mounted at /run/results.

    `repo`, when given, is shared read-only with the tag `repo`: the guest's
    /tmp is a tmpfs, so a checkout under the host's /tmp (as CI's may be) is
    hidden there, and `repo_mount_script` mounts it back at the same path.
    `devices` are more QEMU options for devices at fixed addresses (SRIOV_NVME),
    placed before the 9p devices take the free slots.
    Returns when the guest powers off; what the script wrote is in `results`.
    """
    results.mkdir(parents=True, exist_ok=True)
    (results / "run.sh").write_text(script)
    argv = [
        QEMU,
        "-accel",
        "tcg",
        "-m",
        "1024",
        "-smp",
        "1",
        "-machine",
        "q35,kernel-irqchip=split",
        "-device",
        "intel-iommu,intremap=on,caching-mode=on",
        # The GPU-shaped pair first, so the 9p devices do not take slot 2.
        "-device",
        "bochs-display,addr=02.0,multifunction=on",
        "-device",
        "ich9-intel-hda,addr=02.1",
        *devices,
        "-nographic",
        "-nodefaults",
        "-no-reboot",
        "-serial",
        "stdio",
        "-kernel",
        str(kernel.vmlinuz),
        "-initrd",
        str(kernel.initramfs),
        "-append",
        KERNEL_COMMAND_LINE,
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-virtfs",
        f"local,path={results},mount_tag=results,security_model=none,multidevs=remap",
    ]
    if repo is not None:
        argv += [
            "-virtfs",
            f"local,path={repo},mount_tag=repo,security_model=none,readonly=on,multidevs=remap",
        ]
    started = time.monotonic()
    completed = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    return Boot(
        time.monotonic() - started, completed.stdout + completed.stderr, completed.returncode
    )


def recorded(directory: Path, booted: Boot, name: str = "results.json") -> dict[str, Any]:
    """What the guest's scenario wrote to `directory/name`, with the run's length, its
    console log and the serial output; a clear failure when it wrote nothing."""
    log = directory / "console.log"
    console = log.read_text(errors="replace") if log.exists() else ""
    results = directory / name
    if not results.exists():
        raise AssertionError(
            f"the guest wrote no results (qemu exit {booted.returncode}):\n"
            f"{booted.serial[-3000:]}\n{console[-3000:]}"
        )
    found: dict[str, Any] = json.loads(results.read_text())
    found.update(boot_seconds=round(booted.seconds, 1), console=console, serial=booted.serial)
    return found
