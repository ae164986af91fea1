"""Runs INSIDE the QEMU guest booted with `guest.SRIOV_NVME` (host's /usr/bin/python3,
this checkout on PYTHONPATH): SR-IOV on the real kernel, with the package's own code.

QEMU's emulated NVMe controller stands in for a GPU's physical function.  The
virtual functions are created and torn down by writing `sriov_numvfs` the way
the arbiter writes what can block: through `blocking.ChildWriter` (a helper
process) under `blocking.bounded` (the watchdog).  The PF↔VF relation is read
with `Sysfs`, shown by the real `detect --json`, and a VF configured as a token
by its address goes to vfio-pci and back through `LocalHost.switch`.  Then the
fault the issue is about: a process holds a VF's VFIO device fd (group,
container, IOMMU type, device fd: what QEMU does) and the count is set to 0.

Nothing here asserts: every step records what it saw (errnos, links, drivers,
process states, seconds) in /run/results/results.json and goes on.

Usage: sriov_scenario.py KERNEL_ROOT
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scenario import RESULTS, VM_PROGRAM, cli, modprobe, wait_for

from charly_arbiter.core.config import load_config
from charly_arbiter.core.host import NO_DRIVER
from charly_arbiter.core.tokens import TokenCatalogue
from charly_arbiter.errors import ArbiterError
from charly_arbiter.host.blocking import ChildWriter, TimedOut, bounded
from charly_arbiter.host.detect import detect, render
from charly_arbiter.host.local import LocalHost
from charly_arbiter.host.sysfs import Sysfs, write_attribute

WATCHDOG = 2.0  # seconds the watchdog gives a write of sriov_numvfs
CONFIG = """
host = "local"
state_dir = "/run/state-sriov"

[timeouts]
driver_switch = 10

[tokens.pf]
address = "{pf}"

[tokens.vf0]
address = "{vf0}"
"""


def seconds_since(started: float) -> float:
    return round(time.monotonic() - started, 3)


def dmesg() -> list[str]:
    """The kernel's messages since the last call (and clears them)."""
    done = subprocess.run(["/usr/bin/dmesg", "-c"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()


def process_state(pid: int) -> dict[str, Any]:
    """What ps would say of a process: its state letter, where it sleeps, its kernel stack."""
    proc = Path("/proc") / str(pid)
    seen: dict[str, Any] = {"pid": pid}
    try:
        stat = (proc / "stat").read_text()
        seen["state"] = stat[stat.rindex(")") + 2]
        seen["wchan"] = (proc / "wchan").read_text()
        seen["stack"] = [
            line.split("] ", 1)[-1] for line in (proc / "stack").read_text().splitlines()
        ]
    except OSError as error:
        seen["gone"] = error.strerror
    return seen


def children() -> set[int]:
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        found |= {int(pid) for pid in (task / "children").read_text().split()}
    return found


class Numvfs:
    """Writes of sriov_numvfs as the arbiter makes blocking writes: a helper process
    does the write, the watchdog gives up on it after WATCHDOG seconds."""

    def __init__(self, sysfs: Sysfs, pf: str) -> None:
        self.path = sysfs.device(pf) / "sriov_numvfs"
        self.writer = ChildWriter(write_attribute)

    def write(self, text: str, timeout: float = 60) -> dict[str, Any]:
        started = time.monotonic()
        try:
            bounded(lambda: self.writer(self.path, text), timeout, f"sriov_numvfs {text}")
        except TimedOut:
            return {"wrote": text, "hung": True, "seconds": seconds_since(started)}
        except OSError as error:
            code = errno.errorcode.get(error.errno or 0, str(error.errno))
            return {"wrote": text, "errno": code, "seconds": seconds_since(started)}
        return {"wrote": text, "errno": None, "seconds": seconds_since(started)}


def relation(sysfs: Sysfs, pf: str) -> dict[str, Any]:
    """The PF↔VF relation as the package reads it."""
    function = sysfs.function(pf)
    vfs = function.sriov.vfs if function.sriov else ()
    seen: dict[str, Any] = {
        "total_vfs": function.sriov.total_vfs if function.sriov else None,
        "vfs": list(vfs),
        "vf": {},
    }
    for vf in vfs:
        each = sysfs.function(vf)
        seen["vf"][vf] = {
            "physfn": each.physfn,
            "iommu_group": each.iommu_group,
            "driver": each.driver,
            "ids": f"{each.vendor}:{each.device}",
            "class": each.pci_class,
            "config_vendor": sysfs.config_vendor(vf),
        }
    return seen


def links(sysfs: Sysfs, pf: str, vfs: list[str]) -> dict[str, Any]:
    """What is left of the VFs in sysfs, read without the device lock."""
    device = sysfs.device(pf)
    return {
        "virtfn_links": sorted(n for n in os.listdir(device) if n.startswith("virtfn")),
        "vf_dirs": {vf: sysfs.exists(vf) for vf in vfs},
        "vf_physfn": {vf: sysfs.physfn(vf) for vf in vfs},
        "vf_driver": {vf: sysfs.current_driver(vf) for vf in vfs},
    }


def timed(record: dict[str, Any], name: str, action: Callable[[], Any]) -> Any:
    started = time.monotonic()
    try:
        return action()
    except ArbiterError as error:
        record[f"{name}_error"] = str(error)
        return None
    finally:
        record[f"{name}_seconds"] = seconds_since(started)


class Guest:
    def __init__(self, kernel_root: str) -> None:
        self.kernel_root = kernel_root
        self.out: dict[str, Any] = {"errors": {}, "step_seconds": {}}
        self.sysfs = Sysfs()
        self.pf = ""
        self.vfs: list[str] = []

    def save(self) -> None:
        (RESULTS / "results.json").write_text(json.dumps(self.out, indent=1, default=str))

    def step(self, name: str, action: Callable[[], None]) -> None:
        started = time.monotonic()
        try:
            action()
        except Exception:
            self.out["errors"][name] = traceback.format_exc()
        self.out["step_seconds"][name] = seconds_since(started)
        self.save()

    # -- the steps ------------------------------------------------------------------------

    def setup(self) -> None:
        modprobe(self.kernel_root, "nvme", "vfio-pci", "vfio_iommu_type1")
        capable = [a for a in self.sysfs.addresses() if self.sysfs.sriov(a) is not None]
        self.out["capable"] = capable
        self.pf = capable[0]
        wait_for(lambda: self.sysfs.current_driver(self.pf) == "nvme", 20)
        before = self.sysfs.function(self.pf)
        attributes = ("sriov_offset", "sriov_stride", "sriov_vf_device", "sriov_drivers_autoprobe")
        self.out["pf"] = {
            "address": self.pf,
            "driver": before.driver,
            "iommu_group": before.iommu_group,
            "ids": f"{before.vendor}:{before.device}",
            "class": before.pci_class,
            "sriov": [before.sriov.total_vfs, list(before.sriov.vfs)] if before.sriov else None,
            **{name: self.sysfs.attribute(self.pf, name) for name in attributes},
        }
        # The VFs stay without a driver (nvme would take them), as a GPU's VFs for VMs.
        write_attribute(self.sysfs.device(self.pf) / "sriov_drivers_autoprobe", "0")
        self.numvfs = Numvfs(self.sysfs, self.pf)
        dmesg()

    def create(self) -> None:
        record = self.out["create"] = self.numvfs.write("2")
        record["relation"] = relation(self.sysfs, self.pf)
        self.vfs = record["relation"]["vfs"]
        record["dmesg"] = dmesg()
        # What the kernel refuses while 2 VFs exist, and what it takes.
        self.out["refusals"] = {text: self.numvfs.write(text) for text in ("1", "3", "x", "2")}
        self.out["refusals"]["dmesg"] = dmesg()
        self.out["after_refusals"] = relation(self.sysfs, self.pf)["vfs"]

    def detect(self) -> None:
        config = Path("/run/sriov.toml")
        Path("/run/state-sriov").mkdir(mode=0o700, exist_ok=True)
        config.write_text(CONFIG.format(pf=self.pf, vf0=self.vfs[0]))
        self.config = load_config(config, environ={})
        result = cli(config, "detect", "--json")
        self.out["detect_cli"] = {k: v for k, v in result.items() if k != "stdout"}
        self.out["detect"] = json.loads(result["stdout"])
        # The text from this process: another interpreter costs 10 s and more under TCG.
        self.out["detect_text"] = render(detect(LocalHost(self.config)))

    def switch_vf(self) -> None:
        """VF0 as a token of its own, configured by its address: to vfio-pci and back."""
        host = LocalHost(self.config)
        self.host = host
        catalogue = TokenCatalogue(self.config, host)
        vf0, pf = catalogue.resolve(["vf0", "pf"])
        self.vf_token, self.pf_token = vf0, pf
        record: dict[str, Any] = {
            "vf_token_functions": [f.address for f in vf0.functions],
            "vf_token_physical_function": vf0.physical_function,
            "pf_token_functions": [f.address for f in pf.functions],
            "pf_token_virtual_functions": list(pf.virtual_functions),
        }
        self.out["switch_vf"] = record
        address = self.vfs[0]
        group = self.sysfs.iommu_group(address)
        node = Path("/dev/vfio") / str(group)
        timed(record, "to_vfio", lambda: host.switch(vf0, {address: "vfio-pci"}))
        record["on_vfio"] = {"driver": self.sysfs.current_driver(address), "node": node.exists()}
        timed(record, "home", lambda: host.switch(vf0, {address: NO_DRIVER}))
        record["home"] = {"driver": self.sysfs.current_driver(address), "node": node.exists()}
        record["dmesg"] = dmesg()

    def switch_pf(self) -> None:
        """The whole PF to vfio-pci while its VFs exist (what item 2 will refuse)."""
        record: dict[str, Any] = {}
        self.out["switch_pf"] = record
        self.host.switcher.bind_wait = 1.0
        timed(record, "to_vfio", lambda: self.host.switch(self.pf_token, {self.pf: "vfio-pci"}))
        record["pf_driver"] = self.sysfs.current_driver(self.pf)
        record["relation"] = relation(self.sysfs, self.pf)
        record["dmesg"] = dmesg()
        # Without a driver on the PF the count cannot be changed (and its VFs stay).
        unbind = self.sysfs.device(self.pf) / "driver" / "unbind"
        write_attribute(unbind, self.pf)
        record["unbound_vfs"] = relation(self.sysfs, self.pf)["vfs"]
        record["without_driver"] = self.numvfs.write("0")
        write_attribute(self.sysfs.drivers_probe(), self.pf)
        record["rebound"] = wait_for(lambda: self.sysfs.current_driver(self.pf) == "nvme", 20)
        record["dmesg_unbound"] = dmesg()

    def teardown_group_held(self) -> None:
        """Count to 0 while VF0 is on vfio-pci and a process has only its group file open."""
        vf0 = self.vfs[0]
        record: dict[str, Any] = {}
        self.out["teardown_group_held"] = record
        timed(record, "to_vfio", lambda: self.host.switch(self.vf_token, {vf0: "vfio-pci"}))
        node = Path("/dev/vfio") / str(self.sysfs.iommu_group(vf0))
        holder = os.open(node, os.O_RDWR)
        try:
            record.update(self.numvfs.write("0"))
            record["after"] = links(self.sysfs, self.pf, self.vfs)
            record["node_exists"] = node.exists()
        finally:
            os.close(holder)
        record["dmesg"] = dmesg()

    def hung_teardown(self) -> None:
        """Count to 0 while a process holds VF0's VFIO device fd: the write blocks."""
        record: dict[str, Any] = {"watchdog": WATCHDOG}
        self.out["hung"] = record
        record["recreate"] = self.numvfs.write("2")
        self.vfs = relation(self.sysfs, self.pf)["vfs"]
        vf0 = self.vfs[0]
        timed(record, "to_vfio", lambda: self.host.switch(self.vf_token, {vf0: "vfio-pci"}))
        group = record["group"] = str(self.sysfs.iommu_group(vf0))
        go, ready = Path("/run/vf-go"), Path("/run/vf-ready")
        go.touch()
        holder = subprocess.Popen(
            [sys.executable, "-c", VM_PROGRAM, group, vf0, str(go), str(ready)],
            stderr=subprocess.PIPE,
        )
        try:
            self.watch_the_hang(record, holder, ready)
        finally:
            if holder.poll() is None:  # whatever failed, the VFs must not stay stuck
                holder.kill()
                holder.wait()

    def watch_the_hang(
        self, record: dict[str, Any], holder: subprocess.Popen[bytes], ready: Path
    ) -> None:
        group = record["group"]
        record["holder_has_device_fd"] = wait_for(ready.exists, 60)
        dmesg()
        # A fresh writer, so that the helper forked for this write is the one to watch.
        numvfs = Numvfs(self.sysfs, self.pf)
        before = children()
        started = time.monotonic()
        record["write"] = numvfs.write("0", timeout=WATCHDOG)
        record["detected_after"] = seconds_since(started)
        helpers = children() - before - {holder.pid}
        helper = min(helpers) if helpers else None
        record["helper"] = process_state(helper) if helper else None
        # A reader of sriov_numvfs takes the same device lock.
        reader = subprocess.Popen(
            ["/usr/bin/cat", str(numvfs.path)], stdout=subprocess.PIPE, text=True
        )
        time.sleep(1)
        record["reader_blocked"] = reader.poll() is None
        record["reader"] = process_state(reader.pid)

        # The package's reads take no lock: they should answer at once, and show what
        # is left.  Bounded all the same, so that a read that blocks is seen, not waited on.
        def read() -> dict[str, Any]:
            return {
                "relation": relation(self.sysfs, self.pf),
                "links": links(self.sysfs, self.pf, self.vfs),
            }

        reading = time.monotonic()
        try:
            record["package_reads"] = bounded(read, 20, "package reads")
        except TimedOut:
            record["package_reads"] = "blocked"
        record["package_reads_seconds"] = seconds_since(reading)
        reading = time.monotonic()
        try:
            found = bounded(lambda: detect(self.host), 20, "detect")
            record["detect_pf"] = [
                {"address": f.address, "physfn": f.physfn, "sriov": f.sriov}
                for f in found.functions
                if f.address == self.pf or f.address in self.vfs
            ]
        except TimedOut:
            record["detect_pf"] = "blocked"
        record["detect_seconds"] = seconds_since(reading)
        record["vfio_node_while_hung"] = (Path("/dev/vfio") / group).exists()
        record["dmesg_while_hung"] = dmesg()
        record["hung_for"] = seconds_since(started)
        killed = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        record["holder_killed_at"] = seconds_since(started)
        record["reader_returned"] = wait_for(lambda: reader.poll() is not None, 60)
        record["reader_returned_after_kill"] = seconds_since(killed)
        record["reader_output"] = reader.communicate(timeout=10)[0].strip()
        gone = wait_for(lambda: not any(self.sysfs.exists(vf) for vf in self.vfs), 60)
        record["vfs_gone"] = gone
        record["vfs_gone_after_kill"] = seconds_since(killed)
        record["after"] = links(self.sysfs, self.pf, self.vfs)
        time.sleep(0.2)
        record["helper_after"] = process_state(helper) if helper else None
        record["dmesg_after_kill"] = dmesg()
        # The helper that was stuck comes back to the writer: the next write goes through.
        record["next_write"] = numvfs.write("0")
        record["relation_after"] = relation(self.sysfs, self.pf)
        numvfs.writer.close()

    def run(self) -> None:
        self.out["kernel"] = os.uname().release
        self.out["uptime_at_start"] = float(Path("/proc/uptime").read_text().split()[0])
        for name, action in (
            ("setup", self.setup),
            ("create", self.create),
            ("detect", self.detect),
            ("switch_vf", self.switch_vf),
            ("switch_pf", self.switch_pf),
            ("teardown_group_held", self.teardown_group_held),
            ("hung_teardown", self.hung_teardown),
        ):
            self.step(name, action)
        try:  # reading sriov_numvfs blocks while a change of the count is stuck
            numvfs = bounded(lambda: self.sysfs.attribute(self.pf, "sriov_numvfs"), 30, "read")
        except TimedOut:
            numvfs = "blocked"
        self.out["final"] = {
            "numvfs": numvfs,
            "pf_driver": self.sysfs.current_driver(self.pf),
            "dmesg": dmesg(),
        }
        self.save()


if __name__ == "__main__":
    Guest(sys.argv[1]).run()
