"""Boot the real-kernel guest with systemd as PID 1, and run scenarios in it.

The same Debian kernel and GPU-shaped pair as guest.py (bochs-display at 02.0,
ich9-intel-hda at 02.1, one IOMMU group, under an emulated Intel IOMMU), but
the root is writable and systemd runs it: a busybox initramfs mounts this
machine's root over 9p, read-only with `cache=loose` (twice as fast to boot as
no cache), as the lower layer of an overlay whose upper layer is a tmpfs, so
the host's files are never written.  Three 9p shares:

- `hostroot`: this machine's `/`, the overlay's lower layer;
- `share`: a directory of the test's (read-write), at /charly/share in the
  guest: the payload copied onto the root before systemd starts, the scenario
  plan, the results (JSON, one file per boot), and the directories kept across
  reboots (`Spec.keep`, bind-mounted where the guest expects them);
- `repo`: this checkout, read-only, at /charly/repo (the guest's /tmp is a
  tmpfs: a checkout under the host's /tmp would be hidden at its own path).

The payload (built here, per test) makes the host's root boot as a small
machine: the kernel's modules where udev finds them (so it loads bochs and
snd_hda_intel at coldplug), a tmpfs on /tmp, every service, socket and timer
the host enables masked (on a CI machine: libvirtd, Podman, Cockpit, apt's
timers; they would start under TCG too), no serial getty, no /.dockerenv (with
it systemd believes it runs in a container), optionally the package as `make
install` laid it out, weston as `display-manager.service` in a real logind
session (`Boot.desktop`), and a unit that runs sysrunner.py once the boot is
done: it runs the boot's scenarios (functions of a module in tests/kernel)
and writes what they recorded to `results-N.json` on the share.

A spec may ask for several boots in one QEMU run (`Spec.boots`): the share
counts them, each boot gets its own payload on top of the common one, and a
scenario may end its boot as a crash (sysrq `b`); the last boot powers off.
Measured boot times are in each boot's `system` record (`kernel start ->
multi-user.target / graphical.target`, from systemd's own timestamps; never
`systemd-analyze blame`, whose first call costs this guest most of a minute).

Results come back through the share, not the serial console: JSON written after
every scenario survives a crash or a timeout of the run, and is never mixed
with the kernel's messages.  The serial console gets the runner's progress
lines (in `Run.serial`, and serial.log beside the share).

Using it (test_systemd_units.py is the example): a module of scenarios in
tests/kernel, each `def scenario_NAME(s: sysrunner.Scenario) -> None` recording
into `s.out` and `s.step(LABEL)` (sysfacts.py has the facts: units, journals,
sessions, seats, inhibitors, consoles, the card's holders, the ledger), and a
module-scoped fixture that calls `run(kernel_for_tests(...), directory,
Spec(boots=(Boot(("a", "b"), desktop=True), ...), module=..., installed=...))`
once; the tests read `Run.scenario(NAME)`, which fails with the scenario's
traceback and evidence if it raised.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guest import (
    INITRAMFS_MODULES,
    KERNEL_COMMAND_LINE,
    QEMU,
    Kernel,
    cached_initramfs,
)
from libvirt_units import LIBVIRT_UNITS  # left alone (not started, not masked) for libvirt

REPO = Path(__file__).resolve().parents[2]
SHARE = "/charly/share"  # the share, in the guest
REPO_IN_GUEST = "/charly/repo"
RUNNER_UNIT = "charly-scenarios.service"
DISPLAY_UNIT = "charly-weston.service"
DESKTOP_USER = "charly-weston"
# Units the host enables that the guest keeps (a text login on tty1, as any machine).
KEEP_ENABLED = frozenset({"getty@tty1.service"})
# Never wanted in the guest: a login prompt on the console the results come back on, and
# early-boot units no test here looks at (API file systems nothing mounts on, module
# loads for devices the guest lacks, boot records and seeds), each a process or a mount
# that costs this single-vCPU guest under TCG a second or more of its boot.
ALWAYS_MASKED = (
    "serial-getty@ttyS0.service",
    "console-getty.service",
    "dev-hugepages.mount",
    "dev-mqueue.mount",
    "sys-kernel-tracing.mount",
    "sys-fs-fuse-connections.mount",
    "sys-kernel-config.mount",
    "proc-sys-fs-binfmt_misc.automount",
    "systemd-binfmt.service",
    "modprobe@configfs.service",
    "modprobe@dm_mod.service",
    "modprobe@fuse.service",
    "modprobe@loop.service",
    "systemd-random-seed.service",
    "systemd-pstore.service",
    "systemd-update-utmp.service",
    "systemd-update-utmp-runlevel.service",
    "systemd-journal-flush.service",
)

INIT = """#!/bin/busybox sh
# charly-arbiter's systemd guest (tests/kernel/sysguest.py): an overlay root, then systemd.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for module in $(cat /modules.order); do
    insmod /modules/$module || echo "insmod $module failed"
done
fail() { echo "charly-init: $*"; poweroff -f; }
P9=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o $P9,ro,cache=loose hostroot /lower || fail "cannot mount the host root"
mount -t tmpfs -o mode=0755 upper /rw && mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \\
    || fail "cannot mount the overlay"
S=/newroot/charly/share
mkdir -p $S /newroot/charly/repo
mount -t 9p -o $P9 share $S || fail "cannot mount the share"
mount -t 9p -o $P9,ro,cache=loose repo /newroot/charly/repo || fail "cannot mount the checkout"
boot=$(( $(cat $S/boots 2>/dev/null || echo 0) + 1 ))
echo $boot > $S/boots
[ -d $S/root-$boot ] || fail "boot $boot: the spec asks for fewer boots"
# -f: a payload file may replace one of the host's (a link that a package test on this
# machine has just enabled, say)
cp -af $S/root/. /newroot/ || fail "cannot copy the payload"
cp -af $S/root-$boot/. /newroot/ || fail "cannot copy boot $boot's payload"
rm -f /newroot/.dockerenv /newroot/.containerenv
if [ -f $S/keep ]; then
    while read -r kept; do
        mkdir -p "$S/kept$kept" "/newroot$kept"
        mount --bind "$S/kept$kept" "/newroot$kept" || fail "cannot keep $kept"
    done < $S/keep
fi
[ -f $S/early.sh ] && . $S/early.sh
cut -d' ' -f1 /proc/uptime > $S/switch-root-$boot
echo "charly-init: boot $boot, exec systemd"
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root -c /dev/console /newroot /lib/systemd/systemd
"""
INITRAMFS_SYSTEMD_MODULES = (*INITRAMFS_MODULES, "overlay")

RUNNER = """[Unit]
Description=charly-arbiter test scenarios (tests/kernel/sysrunner.py)
After={target}

[Service]
Type=simple
ExecStart=/usr/bin/python3 {repo}/tests/kernel/sysrunner.py
Environment=PYTHONDONTWRITEBYTECODE=1 SYSTEMD_COLORS=0 SYSTEMD_PAGER= TERM=dumb LANG=C.UTF-8
StandardOutput=tty
StandardError=tty
TTYPath=/dev/ttyS0
"""
# weston's DRM backend on bochs-drm's card0, in a real logind session on tty7: what a
# display manager's greeter is (test-hosts.md, "A compositor in a real logind session").
WESTON = """[Unit]
Description=Weston on the DRM device, in a logind session (the test's display manager)
Requires=systemd-user-sessions.service
After=systemd-user-sessions.service systemd-logind.service dbus.socket getty@tty7.service
Wants=dbus.socket
Conflicts=getty@tty7.service
ConditionPathExists=/dev/tty0

[Service]
Type=notify
ExecStart=/usr/bin/weston --backend=drm-backend.so --use-pixman --continue-without-input \\
    --idle-time=0 --modules=systemd-notify.so
User={user}
Group={user}
WorkingDirectory=~
PAMName=login
Environment=XDG_SESSION_TYPE=wayland
TTYPath=/dev/tty7
TTYReset=yes
TTYVHangup=yes
TTYVTDisallocate=yes
StandardInput=tty-fail
StandardOutput=journal
StandardError=journal
UtmpIdentifier=tty7
UtmpMode=user
TimeoutStartSec=180

[Install]
Alias=display-manager.service
"""


@dataclass(frozen=True)
class Boot:
    """One boot of the guest: the scenarios it runs (`scenario_NAME` functions of the
    spec's module, in order; `STEM:NAME` is one of tests/kernel/STEM.py, recorded as
    NAME) and whether a desktop comes up (graphical.target with weston as
    display-manager.service) or not (multi-user.target)."""

    scenarios: tuple[str, ...]
    desktop: bool = False


@dataclass(frozen=True)
class Spec:
    """What a guest run needs.  `module` is a file in tests/kernel; `installed` a
    `make install DESTDIR=...` tree copied onto the root (parts: INSTALLED);
    `files` more files (guest path -> text; executable when it starts with `#!`),
    written after it; `links` symbolic links (guest path -> target: `systemctl
    enable` as a package's postinst does it); `keep` guest directories that
    survive the reboots (on the share: `kept/PATH`)."""

    boots: tuple[Boot, ...]
    module: str
    installed: Path | None = None
    files: Mapping[str, str] = field(default_factory=dict)
    links: Mapping[str, str] = field(default_factory=dict)
    keep: tuple[str, ...] = ()
    libvirt: bool = False
    smp: int = 1
    memory_mib: int = 2048


# What of `make install`'s tree the guest gets: the program, the package, the hooks, the
# configuration, the units and the tmpfiles rule (not the man pages or documents).
INSTALLED = ("etc", "usr/bin", "usr/lib", "usr/libexec")


@dataclass
class Run:
    """A finished guest run: each boot's record (sysrunner.py's `results-N.json`)."""

    seconds: float
    serial: str
    returncode: int
    boots: list[dict[str, Any]]

    def boot(self, number: int) -> dict[str, Any]:
        assert len(self.boots) >= number, (
            f"boot {number} left no results (qemu exit {self.returncode}):\n{self.serial[-4000:]}"
        )
        return self.boots[number - 1]

    def scenario(self, name: str) -> dict[str, Any]:
        """The record of scenario `name`; fails with its evidence (traceback, units,
        journal) when it raised."""
        for record in self.boots:
            if name in record["errors"]:
                raise AssertionError(
                    f"scenario {name} failed in boot {record['boot']}:\n"
                    f"{record['errors'][name]}\nevidence: "
                    + json.dumps(record["evidence"].get(name), indent=1, default=str)[-6000:]
                )
            if name in record["scenarios"]:
                found: dict[str, Any] = record["scenarios"][name]
                return found
        raise AssertionError(
            f"scenario {name} did not run (qemu exit {self.returncode}; boots recorded: "
            f"{len(self.boots)}):\n{self.serial[-4000:]}"
        )

    def timings(self) -> str:
        """One line per boot: when systemd reached its targets, and each scenario's time."""
        lines = [f"guest run {self.seconds:.1f} s"]
        for record in self.boots:
            system = record.get("system", {})
            lines.append(
                f"boot {record['boot']}: "
                + ", ".join(f"{k} {v}" for k, v in system.get("reached", {}).items())
                + f"; scenarios {record.get('seconds')}"
            )
        return "\n".join(lines)


def prepare_initramfs(kernel: Kernel) -> Path:
    """The systemd guest's initramfs for `kernel`, built once (named by its init's hash)."""
    return cached_initramfs(
        kernel.root,
        kernel.version,
        "initramfs-systemd",
        INIT,
        INITRAMFS_SYSTEMD_MODULES,
        directories=("lower", "rw", "newroot"),
    )


def host_enabled_units(etc: Path = Path("/etc/systemd/system")) -> set[str]:
    """The services, sockets, timers and paths this machine's root enables."""
    found: set[str] = set()
    for wants in etc.glob("*.wants"):
        for link in wants.iterdir():
            if link.suffix in (".service", ".socket", ".timer", ".path"):
                found.add(link.name)
    return found


def masked_units(libvirt: bool) -> list[str]:
    spared = KEEP_ENABLED | (LIBVIRT_UNITS if libvirt else frozenset())
    return sorted((host_enabled_units() - spared) | set(ALWAYS_MASKED))


def _link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _free_uid(start: int = 1100) -> int:
    taken = {entry.pw_uid for entry in pwd.getpwall()}
    return next(uid for uid in range(start, 60000) if uid not in taken)


def _desktop_user(root: Path) -> None:
    """A user for the compositor, added to copies of this machine's account files."""
    uid = _free_uid()
    for name, line, mode in (
        (
            "passwd",
            f"{DESKTOP_USER}:x:{uid}:{uid}:charly-arbiter test compositor:"
            f"/home/{DESKTOP_USER}:/bin/sh",
            0o644,
        ),
        ("group", f"{DESKTOP_USER}:x:{uid}:", 0o644),
        ("shadow", f"{DESKTOP_USER}:!:20000:0:99999:7:::", 0o640),
    ):
        text = Path("/etc", name).read_text()
        _write(root / "etc" / name, text.rstrip("\n") + "\n" + line + "\n", mode)
    shutil.chown(root / "etc" / "shadow", group="shadow")
    home = root / "home" / DESKTOP_USER
    home.mkdir(parents=True)
    os.chown(home, uid, uid)


def build_share(share: Path, kernel: Kernel, spec: Spec) -> None:
    """The payload, the plan and the kept directories on the share."""
    share.mkdir(parents=True, exist_ok=True)
    root = share / "root"
    modules = kernel.root / "lib" / "modules" / kernel.version
    _link(root / "usr" / "lib" / "modules" / kernel.version, str(modules))
    _write(root / "etc" / "fstab", "tmpfs /tmp tmpfs mode=1777,nosuid,nodev 0 0\n")
    units = root / "etc" / "systemd" / "system"
    for name in masked_units(spec.libvirt):
        _link(units / name, "/dev/null")
    if spec.installed is not None:
        for part in INSTALLED:
            if (spec.installed / part).exists():
                shutil.copytree(
                    spec.installed / part, root / part, symlinks=True, dirs_exist_ok=True
                )
    for path, text in spec.files.items():
        _write(root / path.lstrip("/"), text, 0o755 if text.startswith("#!") else 0o644)
    for path, target in spec.links.items():
        _link(root / path.lstrip("/"), target)
    if any(boot.desktop for boot in spec.boots):
        _desktop_user(root)
        _write(units / DISPLAY_UNIT, WESTON.format(user=DESKTOP_USER))
    for number, boot in enumerate(spec.boots, start=1):
        mine = share / f"root-{number}" / "etc" / "systemd" / "system"
        target = "graphical.target" if boot.desktop else "multi-user.target"
        _link(mine / "default.target", f"/lib/systemd/system/{target}")
        _write(mine / RUNNER_UNIT, RUNNER.format(target=target, repo=REPO_IN_GUEST))
        _link(mine / f"{target}.wants" / RUNNER_UNIT, f"/etc/systemd/system/{RUNNER_UNIT}")
        if boot.desktop:
            _link(mine / "display-manager.service", f"/etc/systemd/system/{DISPLAY_UNIT}")
    if spec.libvirt:
        # libvirt's units stay, but nothing starts them at boot: a scenario does, once
        # it has configured them (libvirtd probes each QEMU it finds, slowly under TCG).
        enabled = [u for u in host_enabled_units() if u in LIBVIRT_UNITS]
        lines = [f"rm -f /newroot/etc/systemd/system/*.wants/{u}" for u in sorted(enabled)]
        _write(share / "early.sh", "\n".join(lines) + "\n")
    if spec.keep:
        _write(share / "keep", "".join(f"{path}\n" for path in spec.keep))
    names = [name.rpartition(":")[2] for boot in spec.boots for name in boot.scenarios]
    assert len(names) == len(set(names)), f"a scenario name is used twice: {names}"
    plan = {
        "module": f"{REPO_IN_GUEST}/tests/kernel/{spec.module}",
        "boots": [list(boot.scenarios) for boot in spec.boots],
    }
    _write(share / "spec.json", json.dumps(plan, indent=1))


def qemu_argv(kernel: Kernel, initramfs: Path, share: Path, spec: Spec) -> list[str]:
    argv = [
        QEMU,
        "-accel",
        "tcg",
        "-m",
        str(spec.memory_mib),
        "-smp",
        str(spec.smp),
        "-machine",
        "q35,kernel-irqchip=split",
        "-device",
        "intel-iommu,intremap=on,caching-mode=on",
        # The GPU-shaped pair first, so the 9p devices do not take slot 2.
        "-device",
        "bochs-display,addr=02.0,multifunction=on",
        "-device",
        "ich9-intel-hda,addr=02.1",
        "-nographic",
        "-nodefaults",
        "-serial",
        "stdio",
        "-kernel",
        str(kernel.vmlinuz),
        "-initrd",
        str(initramfs),
        "-append",
        f"{KERNEL_COMMAND_LINE} rw",
    ]
    read_only = ",readonly=on"
    shares = (("hostroot", Path("/"), read_only), ("share", share, ""), ("repo", REPO, read_only))
    for tag, path, mode in shares:
        options = f"path={path},mount_tag={tag},security_model=none{mode},multidevs=remap"
        argv += ["-virtfs", f"local,{options}"]
    if len(spec.boots) == 1:
        argv.append("-no-reboot")
    return argv


def run(kernel: Kernel, directory: Path, spec: Spec, timeout: float = 900) -> Run:
    """Boot the guest as `spec` says, and return what each boot recorded."""
    initramfs = prepare_initramfs(kernel)
    share = directory / "share"
    build_share(share, kernel, spec)
    # The checkout is read-only in the guest: compiled here, its modules are not
    # compiled again at every boot (seconds under TCG).
    subprocess.run(
        [
            "/usr/bin/python3",
            "-m",
            "compileall",
            "-q",
            str(REPO / "charly_arbiter"),
            str(REPO / "tests"),
        ],
        capture_output=True,
        timeout=300,
    )
    started = time.monotonic()
    try:
        completed = subprocess.run(
            qemu_argv(kernel, initramfs, share, spec),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
        serial, returncode = completed.stdout + completed.stderr, completed.returncode
    except subprocess.TimeoutExpired as expired:
        serial = _text(expired.stdout) + _text(expired.stderr) + f"\n(timed out after {timeout} s)"
        returncode = -1
    seconds = time.monotonic() - started
    (directory / "serial.log").write_text(serial)
    boots = []
    for number in range(1, len(spec.boots) + 1):
        results = share / f"results-{number}.json"
        if results.exists():
            boots.append(json.loads(results.read_text()))
    return Run(seconds, serial, returncode, boots)


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def kernel_for_tests(required: Sequence[str] = ()) -> Kernel:
    """The kernel (prepare_kernel), after checking QEMU runs and `required` programs exist."""
    import pytest
    from guest import QemuUnavailable, check_qemu, prepare_kernel

    try:
        check_qemu()
    except QemuUnavailable as why:
        pytest.skip(f"QEMU CANNOT RUN HERE, the systemd guest tests are SKIPPED: {why}")
    missing = [path for path in required if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: run scripts/setup (scripts/apt-packages.txt)")
    return prepare_kernel()
