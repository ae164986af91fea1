"""Runs INSIDE the QEMU guest: the whole chain, libvirtd passing the pair through.

The guest kernel's 00:02.0 (bochs-drm) and 00:02.1 (snd_hda_intel), one IOMMU
group, are the GPU and its audio.  This makes the read-only 9p root writable
with overlays on /etc, /usr and /var (upper layers on a tmpfs) and copies
in what `make install DESTDIR=STAGE PREFIX=/usr` installed on the host: the
program, the package, the hook in /etc/libvirt/hooks/qemu.d and the example
configuration are where the package puts them.  It starts
virtlogd and a real libvirtd, and runs real nested QEMU/TCG domains (64 MiB,
no disk, a 36-byte kernel that halts) with the pair as `<hostdev>`s, through
every scenario of tests/kernel/test_chain.py.

An observer hook sits beside the arbiter's in qemu.d (`a-observe`: libvirt
runs qemu.d in name order, so it runs just before `charly-arbiter`); it logs
each call with both functions' drivers.  libvirtd logs its own PCI, hostdev,
hook and QEMU start/stop steps at debug level, and the arbiter its steps in
`hook_log`.  Merged by time, they give the order of libvirt's steps and the
hook calls.

Like scenario.py, nothing here asserts: each step records facts (exit codes,
messages, drivers, /dev/vfio, the ledger, the invariants of tests/invariants.py,
the logs) into /run/results/chain.json and goes on.

Before anything else, on the SR-IOV NVMe controller as QEMU made it, it runs
sriov_scenario.py's steps (results.json, judged by test_sriov_kernel.py): one boot
for both (conftest.py).

Usage: chain.py KERNEL_ROOT STAGE
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
from calendar import timegm
from pathlib import Path
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from invariants import HostFacts, violations  # noqa: E402
from scenario import (  # noqa: E402
    VFIO_GROUP_GET_DEVICE_FD,
    VFIO_GROUP_SET_CONTAINER,
    VFIO_SET_IOMMU,
    VFIO_TYPE1_IOMMU,
)
from sriov_scenario import Guest as SriovGuest  # noqa: E402

from charly_arbiter.core.ledger import Ledger  # noqa: E402

GPU = "0000:00:02.0"
AUDIO = "0000:00:02.1"
HOME = {GPU: "bochs-drm", AUDIO: "snd_hda_intel"}
SYS = Path("/sys/bus/pci")
RESULTS = Path("/run/results")
WORK = Path("/run/chain")
STATE_DIR = Path("/var/lib/charly-arbiter")  # the default: the configurations name none
CONFIG = Path("/etc/charly-arbiter/arbiter.toml")
HOOK_LOG = WORK / "hook.log"
OBSERVED = WORK / "observed.log"
# when this guest booted, on the clock of time.time() (the observer logs its uptime)
BOOTED = time.time() - float(Path("/proc/uptime").read_text().split()[0])
OBSERVER_NAME = "a-observe"  # before "charly-arbiter": libvirt runs qemu.d in name order
LIBVIRT_LOG = Path("/var/log/libvirt/chain-debug.log")
ARBITER_HOOK = "/etc/libvirt/hooks/qemu.d/charly-arbiter"  # where `make install` puts it
CLI = "/usr/bin/charly-arbiter"
VIRSH = "/usr/bin/virsh"
URI = "qemu:///system"
QEMU_SETTINGS = """
# charly-arbiter chain test: run QEMU as root without cgroups, labels or namespaces
user = "root"
group = "root"
cgroup_controllers = [ ]
security_driver = "none"
namespaces = [ ]
"""
# libvirt's own steps: its PCI layer, the hostdev manager, the hook runner, QEMU start/stop.
LIBVIRTD_LOGGING = """
log_filters="1:util.pci 1:hostdev 1:util.hook 1:qemu.qemu_process 4:*"
log_outputs="1:file:{log}"
"""
TOKEN_CONFIG = """
hook_log = "{hook_log}"
device_holder_policy = "{policy}"

[timeouts]
lock_wait = 30
holder_stop = 5
driver_switch = 10
libvirt_call = 30
claim_grace = 60

[tokens.gpu]
address = "{gpu}"
# fbcon draws on bochs-drm's fb0 in this guest: the arbiter takes it off and back.
console = "release"
"""
OBSERVER = """#!/bin/sh
# When libvirt calls its qemu hooks, and where the pair is then (this runs
# before the arbiter's hook: libvirt runs qemu.d in name order).  Shell
# builtins only: every program started costs this guest a tenth of a second.
read -r uptime _ < /proc/uptime
cd -P /sys/bus/pci/devices/{gpu}/driver 2>/dev/null && gpu=${{PWD##*/}} || gpu=none
cd -P /sys/bus/pci/devices/{audio}/driver 2>/dev/null && audio=${{PWD##*/}} || audio=none
echo "$uptime $* gpu=$gpu audio=$audio" >> {log}
exit 0
"""
DOMAIN = """<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>64</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{kernel}</kernel>
    <bootmenu enable='no'/>
  </os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
{hostdevs}
  </devices>
</domain>
"""
# No ROM BAR: SeaBIOS reading the option ROM through vfio kept the nested VM at
# full speed for ten seconds of this guest's time, every start.
HOSTDEV = """    <hostdev mode='subsystem' type='pci' managed='{managed}'>
      <source><address domain='0x0000' bus='0x00' slot='0x02' function='0x{function}'/></source>
      <rom bar='off'/>
    </hostdev>"""

HALT = WORK / "halt.bin"


def write_halting_kernel(path: Path) -> None:
    """The tiniest guest: a multiboot image (flat, with the header's load addresses)
    whose code is `cli; hlt`.  A nested VM that boots nothing keeps SeaBIOS polling
    for a boot device, a fifth of this guest's CPU for as long as it runs."""
    magic, flags, load = 0x1BADB002, 1 << 16, 0x100000
    code = bytes([0xFA, 0xF4, 0xEB, 0xFD])  # cli; hlt; jmp back to the hlt
    header_size = 32
    end = load + header_size + len(code)
    checksum = -(magic + flags) & 0xFFFFFFFF
    header = struct.pack("<8I", magic, flags, checksum, load, load, end, end, load + header_size)
    path.write_bytes(header + code)


# -- small facts ------------------------------------------------------------------------


def driver(address: str) -> str | None:
    try:
        return os.path.basename(os.readlink(SYS / "devices" / address / "driver"))
    except OSError:
        return None


def drivers() -> dict[str, str | None]:
    return {address: driver(address) for address in (GPU, AUDIO)}


def vfio_nodes() -> list[str]:
    try:
        return sorted(os.listdir("/dev/vfio"))
    except OSError:
        return []


def wait_for(predicate: Any, seconds: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def run(argv: list[str], timeout: float = 120, **kw: Any) -> dict[str, Any]:
    started = time.monotonic()
    began = time.time()
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
        rc, out, err = result.returncode, result.stdout, result.stderr
    except subprocess.TimeoutExpired as expired:
        rc, out, err = None, str(expired.stdout or ""), f"timed out after {timeout} s"
    return {
        "argv": argv,
        "rc": rc,
        "stdout": out,
        "stderr": err,
        "at": began,
        "seconds": round(time.monotonic() - started, 3),
    }


def virsh(*args: str, timeout: float = 120) -> dict[str, Any]:
    return run([VIRSH, "-c", URI, *args], timeout=timeout)


def cli(*args: str) -> dict[str, Any]:
    return run([CLI, *args])


def modprobe(*modules: str) -> dict[str, Any]:
    return run(["/sbin/modprobe", "-a", *modules])


def ledger() -> dict[str, Any]:
    """The ledger as the invariants and the tests need it (read without the lock)."""
    state = Ledger(STATE_DIR).read()
    return {
        "leases": [
            {
                "claimant": str(lease.claimant),
                "mode": str(lease.mode),
                "state": str(lease.state),
                "tokens": list(lease.tokens),
                "owner_pid": lease.owner_pid,
                "created": lease.created,
                "sleep_locks": list(lease.sleep_locks),
            }
            for lease in state.leases
        ],
        "poisoned": {token: poison.reason for token, poison in state.poisoned},
    }


def invariant_violations(token: str) -> list[str]:
    """I1-I3 over this host: no holder the arbiter could stop runs here (processes it
    terminates do not come back), so only the ledger and the drivers matter."""
    facts = HostFacts(drivers=drivers(), token_functions={token: [GPU, AUDIO]}, running={})
    return violations(Ledger(STATE_DIR).read(), facts)


def qemu_pid(name: str) -> int | None:
    try:
        return int(Path(f"/run/libvirt/qemu/{name}.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_seconds(pid: int | None) -> float | None:
    """User and system time of process `pid` so far (what a nested QEMU costs)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def open_vfio(pid: int | None) -> list[str]:
    """The /dev/vfio nodes process `pid` (a QEMU) holds open."""
    found = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("/dev/vfio/"):
                found.add(target)
    except OSError:
        pass
    return sorted(found)


class Domains:
    """libvirt's word on a domain's state, over one connection (a `virsh` per look
    costs a second of this guest's time), opened again after libvirtd restarts."""

    STATES: ClassVar[dict[int, str]] = {
        1: "running",
        3: "paused",
        4: "shutdown",
        5: "shut off",
        6: "crashed",
    }

    def __init__(self) -> None:
        self.connection: Any = None

    def state(self, name: str) -> str:
        try:
            code = self.call(lambda connection: connection.lookupByName(name).state()[0])
        except Exception as error:
            return f"unknown ({error})"
        return self.STATES.get(code, str(code))

    def define(self, xml: str) -> str:
        return str(self.call(lambda connection: connection.defineXML(xml).name()))

    def call(self, action: Any) -> Any:
        import libvirt

        for attempt in range(2):
            try:
                if self.connection is None:
                    self.connection = libvirt.open(URI)
                return action(self.connection)
            except libvirt.libvirtError:
                self.connection = None
                if attempt:
                    raise
        return None


DOMAINS = Domains()


def domain_state(name: str) -> str:
    return DOMAINS.state(name)


def facts(token: str, name: str | None = None) -> dict[str, Any]:
    """Everything a step is judged by, at this moment."""
    out: dict[str, Any] = {
        "at": time.time(),
        "drivers": drivers(),
        "vfio": vfio_nodes(),
        "card0": Path("/dev/dri/card0").exists(),
        "ledger": ledger(),
        "violations": invariant_violations(token),
        "finish_release_running": finish_release_running(),
    }
    if name is not None:
        pid = qemu_pid(name)
        out["domain"] = {
            "state": domain_state(name),
            "qemu_pid": pid,
            "qemu_alive": alive(pid),
            "qemu_vfio": open_vfio(pid) if alive(pid) else [],
            "qemu_cpu_seconds": cpu_seconds(pid) if alive(pid) else None,
        }
    return out


def finish_release_running() -> list[int]:
    """Detached releases (`charly-arbiter _finish-release`) still at work."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"_finish-release" in argv:
                pids.append(int(entry.name))
    return pids


def settle(token: str) -> dict[str, Any]:
    """Wait until no detached release runs and the pair is home (or 120 s pass: a
    loaded machine's nested TCG is slow, and a settled pair returns at once)."""
    started = time.monotonic()
    wait_for(lambda: not finish_release_running() and drivers() == HOME, 120)
    return {"seconds": round(time.monotonic() - started, 3), **facts(token)}


def holder_of_card0() -> subprocess.Popen[bytes]:
    """A process with /dev/dri/card0 open (as a desktop session's compositor would)."""
    with open("/dev/dri/card0", "rb") as card:
        return subprocess.Popen(["/bin/sleep", "600"], stdin=card)


# -- the setup ----------------------------------------------------------------------------


def overlay(directory: str) -> None:
    """/DIRECTORY writable: the host's files, with an upper layer on a tmpfs."""
    upper, work = Path("/run/overlay", directory, "upper"), Path("/run/overlay", directory, "work")
    upper.mkdir(parents=True)
    work.mkdir(parents=True)
    options = f"lowerdir=/{directory},upperdir={upper},workdir={work}"
    subprocess.run(
        ["/bin/mount", "-t", "overlay", "overlay", "-o", options, f"/{directory}"], check=True
    )


# What of `make install`'s tree the chain runs: the program, the package, the hook
# and the configuration (not the man pages, completions, units or documents).
INSTALLED = ("etc", "usr/bin", "usr/lib/python3")


def install(stage: Path) -> list[dict[str, Any]]:
    """Copy the installed files into place.  They live in the overlays' tmpfs from
    then on: the stage, read through 9p under an overlay, once lost a module in the
    middle of a run (a lookup that failed), and the hook with it."""
    return [run(["/bin/cp", "-a", f"{stage / part}/.", f"/{part}"]) for part in INSTALLED]


def setup(kernel_root: Path, stage: Path, out: dict[str, Any]) -> None:
    version = os.uname().release
    # overlay first (from the unpacked package), then the rest the normal way.
    subprocess.run(["/sbin/modprobe", "-d", str(kernel_root), "overlay"], check=True)
    for directory in ("etc", "usr", "var"):
        overlay(directory)
    modules = Path("/usr/lib/modules")
    modules.mkdir(exist_ok=True)
    (modules / version).symlink_to(kernel_root / "lib" / "modules" / version)
    out["modprobe"] = modprobe("bochs", "snd-hda-intel", "vfio-pci", "vfio_iommu_type1")
    out["home_bound"] = wait_for(lambda: drivers() == HOME, 30)
    for fresh in ("/var/lib/libvirt", "/var/cache/libvirt", "/var/log/libvirt", "/var/run"):
        if not Path(fresh).is_symlink():
            Path(fresh).mkdir(parents=True, exist_ok=True)
            subprocess.run(["/bin/mount", "-t", "tmpfs", "tmp", fresh], check=True)
    out["install"] = install(stage)
    configure_libvirt()
    out["installed_hook"] = sorted(os.listdir("/etc/libvirt/hooks/qemu.d"))
    out["virtlogd"] = run(["/usr/sbin/virtlogd", "-d"])
    out["libvirtd"] = start_libvirtd()
    define_domains(out)


def configure_libvirt() -> None:
    """libvirt as the chain runs it, the package installed: nothing of the host's own
    libvirt use (other hooks, domains, autostarted networks), QEMU as root without
    cgroups, labels or namespaces, libvirtd's own steps logged, the observer hook
    beside the arbiter's, and the nested domains' tiny kernel."""
    WORK.mkdir(parents=True, exist_ok=True)
    libvirt = Path("/etc/libvirt")
    # libvirtd probes every QEMU it finds when it starts (a quarter of a minute each
    # under TCG); the domains here need only qemu-system-x86_64.
    strays = [
        *libvirt.glob("hooks/**/*"),
        *libvirt.glob("qemu/*.xml"),
        *libvirt.glob("qemu/networks/autostart/*"),
        Path("/usr/bin/qemu-system-i386"),
    ]
    for stray in strays:
        if stray != Path(ARBITER_HOOK) and (stray.is_file() or stray.is_symlink()):
            stray.unlink()
    conf = libvirt / "qemu.conf"
    text = conf.read_text()
    if QEMU_SETTINGS.strip() not in text:
        conf.write_text(text + QEMU_SETTINGS)
    daemon_conf = libvirt / "libvirtd.conf"
    daemon_conf.write_text(daemon_conf.read_text() + LIBVIRTD_LOGGING.format(log=LIBVIRT_LOG))
    observer = libvirt / "hooks" / "qemu.d" / OBSERVER_NAME
    observer.write_text(OBSERVER.format(gpu=GPU, audio=AUDIO, log=OBSERVED))
    observer.chmod(0o755)
    for directory in (
        "/run/libvirt",
        "/var/lib/libvirt/qemu",
        "/var/cache/libvirt/qemu",
        "/var/log/libvirt/qemu",
    ):
        Path(directory).mkdir(parents=True, exist_ok=True)
    write_halting_kernel(HALT)


def define_domains(out: dict[str, Any]) -> None:
    """chain-a and chain-b (managed='yes') and chain-n (managed='no'), each with the pair."""
    for name, managed in (("chain-a", "yes"), ("chain-b", "yes"), ("chain-n", "no")):
        hostdevs = "\n".join(HOSTDEV.format(managed=managed, function=f) for f in "01")
        out.setdefault("defined", []).append(
            DOMAINS.define(DOMAIN.format(name=name, hostdevs=hostdevs, kernel=HALT))
        )


def start_libvirtd() -> dict[str, Any]:
    started = time.monotonic()
    socket = Path("/run/libvirt/libvirt-sock")
    socket.unlink(missing_ok=True)  # left by a libvirtd killed with SIGKILL
    result = run(["/usr/sbin/libvirtd", "-d"])
    # (one virsh once the socket is there: it waits for the daemon's drivers)
    result["answered"] = wait_for(socket.exists, 60) and virsh("version", timeout=60)["rc"] == 0
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def libvirtd_pid() -> int | None:
    try:
        return int(Path("/run/libvirtd.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def configure(text: str) -> None:
    CONFIG.write_text(text)


def token_config(policy: str = "refuse") -> str:
    return TOKEN_CONFIG.format(hook_log=HOOK_LOG, policy=policy, gpu=GPU)


# -- the scenarios ------------------------------------------------------------------------


def start_and_destroy(out: dict[str, Any], name: str, token: str) -> None:
    out["start"] = virsh("start", name)
    out["running"] = facts(token, name)
    out["destroy"] = virsh("destroy", name)
    out["destroyed"] = facts(token, name)
    out["settled"] = settle(token)


def scenario_managed_yes(out: dict[str, Any]) -> None:
    """virt-manager's way, with the pair named as a token: start; destroy and start
    back to back; a second VM refused; libvirtd killed and restarted; destroy."""
    configure(token_config())
    out["start"] = virsh("start", "chain-a")
    out["running"] = facts("gpu", "chain-a")
    out["destroy"] = virsh("destroy", "chain-a")
    # what the destroy left, read at once (no virsh call), then the start right after
    out["destroyed"] = {
        "drivers": drivers(),
        "vfio": vfio_nodes(),
        "ledger": ledger(),
        "violations": invariant_violations("gpu"),
    }
    out["back_start"] = virsh("start", "chain-a")
    out["back_running"] = facts("gpu", "chain-a")
    out["second"] = virsh("start", "chain-b")
    out["second_refused"] = facts("gpu", "chain-b")
    out["first_after_second"] = facts("gpu", "chain-a")
    # libvirtd dies (kill -9) while the VM runs, and comes back
    pid = libvirtd_pid()
    qemu = qemu_pid("chain-a")
    os.kill(pid or 0, signal.SIGKILL)
    out["libvirtd_killed"] = {"pid": pid, "gone": wait_for(lambda: not alive(pid), 10)}
    out["while_libvirtd_dead"] = facts_without_libvirt("gpu", qemu)
    out["libvirtd_restart"] = start_libvirtd()
    out["reconnected"] = facts("gpu", "chain-a")
    out["final_destroy"] = virsh("destroy", "chain-a")
    out["final"] = settle("gpu")


def facts_without_libvirt(token: str, qemu: int | None) -> dict[str, Any]:
    return {
        "at": time.time(),
        "drivers": drivers(),
        "vfio": vfio_nodes(),
        "ledger": ledger(),
        "violations": invariant_violations(token),
        "qemu_alive": alive(qemu),
        "qemu_vfio": open_vfio(qemu),
    }


def scenario_managed_no(out: dict[str, Any]) -> None:
    """managed='no': libvirt leaves the drivers alone; the arbiter alone moves them."""
    configure(token_config())
    start_and_destroy(out, "chain-n", "gpu")


def scenario_zero_config_terminating(out: dict[str, Any], example: str) -> None:
    """The shipped example configuration: no tokens at all (every GPU is a token named
    after its address), with only a hook log and `terminate` for processes holding
    the GPU: a process holding /dev/dri/card0 is terminated and the start proceeds."""
    # (at the top: the example's [timeouts] table is not commented out)
    configure(
        f'hook_log = "{HOOK_LOG}"\ndevice_holder_policy = "terminate"\nconsole = "release"\n'
        + example
    )
    holder = holder_of_card0()
    try:
        out["holder_pid"] = holder.pid
        start_and_destroy(out, "chain-a", GPU)
        out["holder_returncode"] = holder.poll()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


def scenario_holder_refused(out: dict[str, Any]) -> None:
    """A process holding /dev/dri/card0 (the default policy, `refuse`): the start is
    refused with its name and pid, and the process runs on."""
    configure(token_config("refuse"))
    holder = holder_of_card0()
    try:
        out["holder_pid"] = holder.pid
        out["start"] = virsh("start", "chain-a")
        out["after"] = facts("gpu", "chain-a")
        out["holder_alive"] = holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
    out["settled"] = settle("gpu")


def scenario_vfio_unavailable(out: dict[str, Any]) -> None:
    """vfio-pci installed but it will not load (an `install ... /bin/false` line, as a
    blacklist does): the switch fails, the token is poisoned, the start refused."""
    configure(token_config())
    blacklist = Path("/etc/modprobe.d/chain-no-vfio.conf")
    out["rmmod"] = run(["/sbin/rmmod", "vfio_pci"])
    blacklist.write_text("install vfio_pci /bin/false\n")
    try:
        out["start"] = virsh("start", "chain-a")
        out["after"] = facts("gpu", "chain-a")
    finally:
        blacklist.unlink()
        out["modprobe_back"] = modprobe("vfio-pci")
    out["clear"] = cli("poison", "clear", "gpu")
    out["cleared"] = facts("gpu")


def scenario_home_driver_gone(out: dict[str, Any]) -> None:
    """snd_hda_intel unloaded while the VM runs, and it will not load again (the arbiter
    loads a home driver that is not loaded, as libvirt loads the stub): the way home
    binds nothing, the token is poisoned and its lease left for `restore`, and `virsh
    destroy` still succeeds.  The operator's way back: let the driver load, clear the
    poison, `restore --stranded`."""
    configure(token_config())
    out["start"] = virsh("start", "chain-a")
    out["rmmod"] = run(["/sbin/rmmod", "snd_hda_intel"])
    blacklist = Path("/etc/modprobe.d/chain-no-hda.conf")
    blacklist.write_text("install snd_hda_intel /bin/false\n")
    try:
        out["destroy"] = virsh("destroy", "chain-a")
        wait_for(lambda: not finish_release_running(), 30)
        out["after"] = facts("gpu", "chain-a")
    finally:
        blacklist.unlink()
    out["modprobe_back"] = modprobe("snd-hda-intel")
    out["clear"] = cli("poison", "clear", "gpu")
    out["restore"] = cli("restore", "--stranded")
    out["restored"] = facts("gpu")


# -- SR-IOV: QEMU's NVMe controller as a GPU's physical function ---------------------------

PF, VF0, VF1 = "0000:01:00.0", "0000:01:00.1", "0000:01:00.2"
SRIOV_CONFIG = """
hook_log = "{hook_log}"

[timeouts]
lock_wait = 30
driver_switch = {timeout}
libvirt_call = 30
claim_grace = 60

[tokens.gpu]
address = "{gpu}"
console = "release"

[tokens.pf]
address = "{pf}"
vfs = 2

[tokens.vf0]
address = "{vf0}"
"""
SRIOV_WATCHDOG = 3  # seconds: timeouts.driver_switch, the count's watchdog too
VF_DOMAIN_HOSTDEV = """    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x0000' bus='0x01' slot='0x00' function='0x1'/></source>
      <rom bar='off'/>
    </hostdev>"""
# A "VM" that holds a VF's VFIO device as QEMU does (container, IOMMU type, device
# fd); with KEEP_GROUP 0 it then closes the group's node, keeping only the device fd
# (which still holds the group): no /dev/vfio/N is left in its fds to be seen.
VF_HOLDER = f"""
import fcntl, os, struct, sys, time
group, address, ready, keep_group = sys.argv[1:5]
container = os.open("/dev/vfio/vfio", os.O_RDWR)
group_fd = os.open(f"/dev/vfio/{{group}}", os.O_RDWR)
fcntl.ioctl(group_fd, {VFIO_GROUP_SET_CONTAINER}, struct.pack("i", container))
fcntl.ioctl(container, {VFIO_SET_IOMMU}, {VFIO_TYPE1_IOMMU})
name = bytearray(address.encode() + b"\\0")
device = fcntl.ioctl(group_fd, {VFIO_GROUP_GET_DEVICE_FD}, name, True)
if keep_group == "0":
    os.close(group_fd)
open(ready, "w").write(str(device))
time.sleep(600)
"""


def sriov_state() -> dict[str, Any]:
    """The PF, its VFs (by their links, and which devices exist) and their drivers."""
    pf = SYS / "devices" / PF
    links = sorted(name for name in os.listdir(pf) if name.startswith("virtfn"))
    return {
        "drivers": {a: driver(a) for a in (PF, VF0, VF1) if (SYS / "devices" / a).exists()},
        "virtfn": links,
        "vfs": [os.path.basename(os.readlink(pf / name)) for name in links],
        "pf_nvme_controller": sorted(os.listdir(pf / "nvme")) if (pf / "nvme").is_dir() else [],
    }


def sriov_facts(name: str | None = None) -> dict[str, Any]:
    state = sriov_state()
    host = HostFacts(
        drivers=state["drivers"],
        token_functions={"pf": [PF], **({"vf0": [VF0]} if VF0 in state["drivers"] else {})},
        running={},
        parents={"vf0": "pf"},
    )
    out: dict[str, Any] = {
        "at": time.time(),
        **state,
        "vfio": vfio_nodes(),
        "ledger": ledger(),
        "violations": violations(Ledger(STATE_DIR).read(), host),
    }
    if name is not None:
        pid = qemu_pid(name)
        out["domain"] = {
            "state": domain_state(name),
            "qemu_alive": alive(pid),
            "qemu_vfio": open_vfio(pid) if alive(pid) else [],
        }
    return out


def iommu_group(address: str) -> str:
    return os.path.basename(os.readlink(SYS / "devices" / address / "iommu_group"))


def hold_vf(address: str, keep_group: bool) -> subprocess.Popen[bytes]:
    ready = Path(f"/run/vf-holder-{address}-{int(keep_group)}")
    ready.unlink(missing_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            VF_HOLDER,
            iommu_group(address),
            address,
            str(ready),
            "1" if keep_group else "0",
        ],
        stderr=subprocess.PIPE,
    )
    if not wait_for(ready.exists, 60):
        holder.kill()
        raise RuntimeError(f"the holder of {address} never opened it: {holder.stderr}")
    return holder


def history_since(since: float) -> list[dict[str, Any]]:
    from charly_arbiter.ops.history import HistoryLog

    return [
        {"at": record.time.timestamp(), "event": record.kind, **record.fields}
        for record in HistoryLog(STATE_DIR).read().records
        if record.time.timestamp() >= since
    ]


def wchans(pattern: str) -> list[dict[str, Any]]:
    """Processes asleep in a kernel function whose name has `pattern` (the write helper
    stuck in the teardown)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            wchan = (entry / "wchan").read_text()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:3]
        except OSError:
            continue
        if pattern in wchan:
            found.append(
                {
                    "pid": int(entry.name),
                    "wchan": wchan,
                    "state": state,
                    "argv": [a.decode(errors="replace") for a in argv],
                }
            )
    return found


def dmesg() -> list[str]:
    done = subprocess.run(["/usr/bin/dmesg", "-c"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()


def scenario_sriov(out: dict[str, Any]) -> None:
    """A GPU that is many, on the real kernel, through the installed CLI and the real
    libvirtd: VFs made by `vfs`; a nested VM with a VF as its hostdev (the hook claims
    the VF, the PF stays on its driver); the PF's exclusive claim and a count change
    refused while the VF is leased; a count change refused while a process holds the
    other VF; the same change, with the holder keeping only its device fd, hung in the
    kernel, met by the watchdog and poisoned; the VFs torn down and made again."""
    begun = time.time()
    out["modprobe"] = modprobe("nvme")
    out["pf_bound"] = wait_for(lambda: driver(PF) == "nvme", 60)
    # The operator's setting for VFs that go to VMs: the host's driver does not take them.
    (SYS / "devices" / PF / "sriov_drivers_autoprobe").write_text("0")
    configure(
        SRIOV_CONFIG.format(hook_log=HOOK_LOG, timeout=SRIOV_WATCHDOG, gpu=GPU, pf=PF, vf0=VF0)
    )
    dmesg()
    out["create"] = cli("vfs", "--json", "pf", "2")
    out["created"] = sriov_facts()
    out["status"] = cli("status", "--json")
    out["defined"] = DOMAINS.define(
        DOMAIN.format(name="chain-vf", hostdevs=VF_DOMAIN_HOSTDEV, kernel=HALT)
    )
    out["vm_start"] = virsh("start", "chain-vf")
    out["vm_running"] = sriov_facts("chain-vf")
    out["pf_refused"] = cli("acquire", "--exclusive", "libvirt:whole", "pf")
    out["count_refused_leased"] = cli("vfs", "pf", "0")
    out["vm_destroy"] = virsh("destroy", "chain-vf")
    # The release finishes detached: wait on its end (the lease gone, no finisher left),
    # not on a time, which a loaded machine's nested TCG overruns.
    since = time.monotonic()
    out["vm_released"] = wait_for(
        lambda: not ledger()["leases"] and not finish_release_running() and driver(VF0) is None,
        180,
    )
    out["vm_released_seconds"] = round(time.monotonic() - since, 3)
    out["vm_destroyed"] = sriov_facts("chain-vf")
    # The second VF, no token, bound to vfio-pci by hand and held as QEMU holds it.
    override = SYS / "devices" / VF1 / "driver_override"
    override.write_text("vfio-pci")
    (SYS / "drivers_probe").write_text(VF1)
    out["vf1_on_vfio"] = wait_for(lambda: driver(VF1) == "vfio-pci", 10)
    holder = hold_vf(VF1, keep_group=True)
    try:
        out["holder_pid"] = holder.pid
        out["count_refused_held"] = cli("vfs", "pf", "0")
    finally:
        holder.kill()
        holder.wait()
    # The same, its group node closed: no scan of /dev nodes sees the holder now.
    holder = hold_vf(VF1, keep_group=False)
    try:
        out["hidden_holder_pid"] = holder.pid
        out["hidden_holder_vfio_fds"] = open_vfio(holder.pid)
        since = time.time()
        out["hung"] = cli("vfs", "--json", "pf", "0")
        out["hung_history"] = history_since(since)
        out["hung_dmesg"] = dmesg()
        out["hung_helper"] = wchans("vfio")
        out["hung_facts"] = sriov_facts()
        out["hung_claims"] = {
            "vf0": cli("acquire", "--exclusive", "libvirt:vm", "vf0"),
            "pf": cli("acquire", "--shared", "container:c", "pf"),
        }
    finally:
        killed = time.monotonic()
        holder.kill()
        holder.wait()
    # (their links went before the write blocked: the devices are what is left)
    out["vfs_gone"] = wait_for(
        lambda: not any((SYS / "devices" / vf).exists() for vf in (VF0, VF1)), 60
    )
    out["vfs_gone_after_kill"] = round(time.monotonic() - killed, 3)
    out["after_kill"] = sriov_facts()
    out["after_kill_dmesg"] = dmesg()
    out["clear"] = cli("poison", "clear", "pf")
    out["recreate"] = cli("vfs", "--json", "pf", "2")
    out["teardown"] = cli("vfs", "--json", "pf", "0")
    out["configured"] = cli("vfs", "--configured")
    out["final"] = sriov_facts()
    out["history"] = history_since(begun)


# -- the logs --------------------------------------------------------------------------------

LIBVIRT_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3})\+0000: \d+: (\w+) : (\S+):\d+ : (.*)$"
)
HOOK_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (\d+) (\w+): (.*)$")


def timeline() -> list[list[Any]]:
    """Every observed event, in time order: [epoch, source, text]."""
    events: list[list[Any]] = []
    if OBSERVED.exists():
        for line in OBSERVED.read_text().splitlines():
            uptime, _, rest = line.partition(" ")
            events.append([BOOTED + float(uptime), "hook", rest])
    if HOOK_LOG.exists():
        for line in HOOK_LOG.read_text().splitlines():
            match = HOOK_LINE.match(line)
            if match:
                day, ms, pid, level, text = match.groups()
                at = time.mktime(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
                events.append([at, f"arbiter[{pid}]", f"{level}: {text}"])
    if LIBVIRT_LOG.exists():
        for line in LIBVIRT_LOG.read_text(errors="replace").splitlines():
            match = LIBVIRT_LINE.match(line)
            if match:
                day, ms, level, function, text = match.groups()
                at = timegm(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
                events.append([at, f"libvirtd {level} {function}", text])
    return sorted(events, key=lambda event: event[0])


def main() -> None:
    kernel_root, stage = Path(sys.argv[1]), Path(sys.argv[2])
    out: dict[str, Any] = {"errors": {}, "step_seconds": {}}
    started = time.monotonic()
    out["guest_uptime_at_start"] = float(Path("/proc/uptime").read_text().split()[0])
    example = (stage / "etc" / "charly-arbiter" / "arbiter.toml").read_text()
    steps = [
        # First, on the PF as QEMU made it: the kernel's SR-IOV facts with the package's
        # own code (sriov_scenario.py, judged by test_sriov_kernel.py from results.json).
        ("sriov_kernel", lambda record: SriovGuest(str(kernel_root)).run()),
        ("setup", lambda record: setup(kernel_root, stage, record)),
        ("managed_yes", scenario_managed_yes),
        ("managed_no", scenario_managed_no),
        ("holder_refused", scenario_holder_refused),
        ("zero_config", lambda record: scenario_zero_config_terminating(record, example)),
        ("vfio_unavailable", scenario_vfio_unavailable),
        ("home_driver_gone", scenario_home_driver_gone),
        ("sriov", scenario_sriov),
    ]
    for name, step in steps:
        record: dict[str, Any] = {}
        out[name] = record
        begun = time.monotonic()
        try:
            step(record)
        except Exception:
            out["errors"][name] = traceback.format_exc()
            if name == "setup":
                break
        out["step_seconds"][name] = round(time.monotonic() - begun, 2)
        (RESULTS / "chain.json").write_text(json.dumps(out, indent=1, default=str))
    out["chain_seconds"] = round(time.monotonic() - started, 2)
    out["timeline"] = timeline()
    for name in ("hook.log", "observed.log"):
        if (WORK / name).exists():
            shutil.copy(WORK / name, RESULTS / name)
    if LIBVIRT_LOG.exists():
        shutil.copy(LIBVIRT_LOG, RESULTS / "libvirtd-debug.log")
    (RESULTS / "chain.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
