"""Stand-ins for Proxmox VE's `qm` and `pct`, which cannot be installed here.

Run as `pve_standin.py ROOT qm|pct ARGS…` (the tests put two-line wrappers in
ROOT/bin).  They behave as qemu-server and pve-container do in what the
arbiter meets (docs/proxmox.md has the source read for each point):

- Files where Proxmox keeps them, under ROOT: `pve/qemu-server/VMID.conf`,
  `pve/lxc/CTID.conf`, `pve/mapping/pci.cfg`; `run/qemu-server/VMID.pid` and
  `run/qemu-server/pci-id-reservations`; the hookscript `local:snippets/NAME`
  is `snippets/NAME`.
- Every command that changes a guest holds its configuration lock (an flock on
  `lock/lock-VMID.conf`, as PVE::AbstractConfig's lock_config), waiting 10 s
  for it (60 s for `qm cleanup`), and fails as Proxmox does when it cannot.
- `qm start`: pending changes applied, then the `pre-start` hookscript (a
  non-zero exit aborts the start: "hookscript error for VMID on pre-start"),
  then qemu-server's own PCI preparation: every function of each hostpci
  device's IOMMU group is bound to vfio-pci unless it is on vfio-pci already
  (pci_dev_group_bind_to_vfio), on the simulated host, and reserved for the VM
  (pci-id-reservations, `pid:`); then "QEMU" (a real process, `-id VMID` on its
  command line) and `post-start`, still under the lock.
- A start can be made to fail after that (ROOT/run/VMID.fail-start): QEMU does
  not come up, the reservations go, and no post-stop runs, as in vm_start_nolock.
- `qm shutdown|stop`: `pre-stop` (warnings only), the end of QEMU (SIGTERM;
  SIGKILL after the timeout with forceStop, or for `stop`), vm_stop_cleanup
  (pidfile and reservations gone, pending changes applied), all under the lock.
- `post-stop` runs from `qm cleanup VMID CLEAN GUEST`, which a watcher runs
  when QEMU's process ends, however it ends (qmeventd's part): after a stop
  through `qm`, it waits for the stop's lock and runs once that returns; after
  a kill -9 it runs at once.
- `qm status|pct status` print `status: running|stopped` and take no lock.
- `pct start|shutdown|stop` do the same for a container: its "init" is a real
  process, and `post-stop` runs when it ends.

What is not stood in for: HA (a stop of an HA-managed guest is only a request
in Proxmox), migration, mediated devices, QMP.  Every step is appended to
ROOT/standin.log as `PID ACTION`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_WAIT = 10.0
CLEANUP_LOCK_WAIT = 60.0
SHUTDOWN_DEFAULT = 60
_PCI = re.compile(r"(?:([a-f0-9]{4,}):)?([a-f0-9]{2}):([a-f0-9]{2})(?:\.([a-f0-9]))?")


class Failed(Exception):
    """What Proxmox would die with: the message, on stderr; exit 255."""


class Pve:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.repo = Path(__file__).resolve().parents[2]

    # -- files ---------------------------------------------------------------------------

    def conf_path(self, kind: str, vmid: str) -> Path:
        return self.root / "pve" / ("qemu-server" if kind == "qm" else "lxc") / f"{vmid}.conf"

    def pidfile(self, kind: str, vmid: str) -> Path:
        return self.root / "run" / ("qemu-server" if kind == "qm" else "lxc") / f"{vmid}.pid"

    def log(self, text: str) -> None:
        with open(self.root / "standin.log", "a") as handle:
            handle.write(f"{os.getpid()} {text}\n")
        with open(self.root / "standin.times", "a") as handle:
            handle.write(f"{time.time():.3f} {os.getpid()} {text}\n")

    def settings(self, kind: str, vmid: str) -> dict[str, str]:
        """The main section's keys (a later key wins, as in parse_vm_config)."""
        found: dict[str, str] = {}
        for line in self.conf_path(kind, vmid).read_text().splitlines():
            if line.startswith("["):
                break
            match = re.fullmatch(r"([a-z][a-z_\-]*\d*):\s*(.+?)\s*", line)
            if match:
                found[match.group(1)] = match.group(2)
        return found

    def apply_pending(self, kind: str, vmid: str) -> None:
        """vmconfig_apply_pending, simply: [PENDING] values replace the main section's,
        its `delete:` keys go, and the section goes."""
        path = self.conf_path(kind, vmid)
        text = path.read_text()
        header = "[PENDING]" if kind == "qm" else "[pve:pending]"
        if f"\n{header}\n" not in f"\n{text}":
            return
        before, _, after = text.partition(f"{header}\n")
        pending, rest = after, ""
        cut = re.search(r"^\[", after, re.MULTILINE)
        if cut:
            pending, rest = after[: cut.start()], after[cut.start() :]
        main = [line for line in before.rstrip("\n").splitlines()]
        for line in pending.splitlines():
            key, _, value = line.partition(":")
            if not key or line.startswith("#"):
                continue
            if key == "delete":
                doomed = set(re.split(r"[,;\s]+", value.strip()))
                main = [m for m in main if m.partition(":")[0] not in doomed]
                continue
            main = [m for m in main if m.partition(":")[0] != key] + [line]
        path.write_text("\n".join(main) + "\n" + (f"\n{rest}" if rest else ""))
        self.log(f"{kind} {vmid} pending applied")

    # -- the lock ------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, kind: str, vmid: str, wait: float = LOCK_WAIT) -> Iterator[None]:
        directory = self.root / "lock"
        directory.mkdir(exist_ok=True)
        name = f"lock-{vmid}.conf" if kind == "qm" else f"pve-config-{vmid}.lock"
        with open(directory / name, "a") as handle:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise Failed(
                            f"can't lock file '{directory / name}' - got timeout"
                        ) from None
                    time.sleep(0.05)
            self.log(f"{kind} {vmid} locked")
            try:
                yield
            finally:
                self.log(f"{kind} {vmid} unlocked")

    # -- processes -----------------------------------------------------------------------

    def pid(self, kind: str, vmid: str) -> int | None:
        try:
            pid = int(self.pidfile(kind, vmid).read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return None
        return None if state in ("Z", "X") else pid

    def hookscript(self, kind: str, vmid: str, phase: str, stop_on_error: bool = False) -> None:
        """exec_hookscript: run SCRIPT VMID PHASE with this environment; its output goes
        to the task log (here: ours)."""
        volume = self.settings(kind, vmid).get("hookscript")
        if not volume:
            return
        storage, _, name = volume.partition(":snippets/")
        script = self.root / "snippets" / name
        try:
            if storage != "local" or not name:
                raise Failed(f"'{volume}' is not in the snippets directory")
            if not script.is_file():
                raise Failed(f"script '{volume}' does not exist")
            if not os.access(script, os.X_OK):
                raise Failed(f"script '{volume}' is not executable")
            result = subprocess.run([str(script), vmid, phase], stdin=subprocess.DEVNULL)
            self.log(f"hookscript {vmid} {phase} rc={result.returncode}")
            if result.returncode < 0:
                raise Failed(
                    f"command '{script} {vmid} {phase}' failed: got signal {-result.returncode}"
                )
            if result.returncode:
                raise Failed(
                    f"command '{script} {vmid} {phase}' failed: exit code {result.returncode}"
                )
        except Failed as error:
            message = f"hookscript error for {vmid} on {phase}: {error}"
            if stop_on_error:
                raise Failed(message) from None
            print(message, file=sys.stderr)

    def launch(self, kind: str, vmid: str) -> int:
        """The guest's process, and its watcher (qmeventd's part, or lxc's post-stop
        hook): a detached process that starts it, waits for it and then cleans up."""
        pidfile = self.pidfile(kind, vmid)
        pidfile.parent.mkdir(parents=True, exist_ok=True)
        pidfile.unlink(missing_ok=True)
        subprocess.Popen(
            [sys.executable, __file__, str(self.root), "watch", kind, vmid],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60  # two Pythons start: slow under TCG
        while time.monotonic() < deadline:
            pid = self.pid(kind, vmid)
            if pid is not None:
                return pid
            time.sleep(0.02)
        raise Failed(f"start failed: {kind} {vmid} did not come up")

    def watch(self, kind: str, vmid: str) -> None:
        """The watcher: start "QEMU" (or the container's init), write its pidfile, wait
        for it, then run `qm cleanup` (or the container's post-stop)."""
        ignore = (self.root / "run" / f"{vmid}.ignore-shutdown").exists()
        holds = self.root / "run" / f"{vmid}.holds"  # device nodes its processes open
        opened = holds.read_text().split() if holds.exists() else []
        body = (
            "import signal, sys, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore else "")
            + "".join(
                f"held_{i} = open({path!r}, 'rb', buffering=0)\n" for i, path in enumerate(opened)
            )
            + "while True: time.sleep(3600)\n"
        )
        name = "qemu-standin" if kind == "qm" else "lxc-init-standin"
        child = subprocess.Popen(
            [sys.executable, "-c", body, name, "-id", vmid, str(self.root)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cgroup = self.root / "run" / f"{vmid}.cgroup"
        if cgroup.exists():
            # lxc-start puts the container's processes in lxc/CTID/ns (pve-container).
            Path(cgroup.read_text().strip(), "cgroup.procs").write_text(f"{child.pid}\n")
        self.pidfile(kind, vmid).write_text(f"{child.pid}\n")
        self.log(f"{kind} {vmid} process {child.pid}")
        child.wait()
        self.log(f"{kind} {vmid} process {child.pid} ended ({child.returncode})")
        clean_marker = self.root / "run" / f"{vmid}.stopping"
        clean = "1" if clean_marker.exists() else "0"
        clean_marker.unlink(missing_ok=True)
        program = self.root / "bin" / kind
        subprocess.run([str(program), "cleanup", vmid, clean, "0"], stdin=subprocess.DEVNULL)

    # -- PCI -----------------------------------------------------------------------------

    def prepare_pci(self, vmid: str, pid_placeholder: str) -> list[str]:
        """qemu-server's reservation and binding for each hostpci line (host= ids, or a
        mapping's first entry for this node): every function of the device's IOMMU
        group to vfio-pci unless it is there already.  Returns the reserved ids.
        Without a simulated host (ROOT/host), on the real kernel of tests/kernel, it
        only looks: it records each function's driver, and binds nothing."""
        if not (self.root / "host" / "host.toml").exists():
            return self._look_at_real_pci(vmid)
        sys.path.insert(0, str(self.repo))
        from charly_arbiter.core.host import TokenSpec
        from charly_arbiter.host.sim import SimHost

        sim = SimHost(self.root / "host")
        drivers = sim.snapshot()["drivers"]
        reserved = []
        for key, value in sorted(self.settings("qm", vmid).items()):
            if not re.fullmatch(r"hostpci\d+", key) or "mdev=" in value:
                continue
            for text in self._host_ids(key, value, vmid):
                match = _PCI.fullmatch(text)
                if match is None:
                    raise Failed(f"no PCI device found for '{text}'")
                domain, bus, slot, function = match.groups()
                prefix = f"{domain or '0000'}:{bus}:{slot}."
                functions = [a for a in drivers if a.startswith(prefix)]
                if function is not None:
                    functions = [a for a in functions if a.endswith(f".{function}")]
                if not functions:
                    raise Failed(f"no PCI device found for '{text}'")
                for address in functions:
                    group = sim.token_functions(address, address)
                    moving = {f.address: "vfio-pci" for f in group if f.driver != "vfio-pci"}
                    if moving:
                        self.log(f"qemu-server binds {','.join(sorted(moving))} to vfio-pci")
                        sim.switch(TokenSpec(address, address, tuple(group)), moving)
                    else:
                        self.log(f"qemu-server finds {address} on vfio-pci already")
                    reserved.append(address)
        lines = [line for line in self._reservations().splitlines() if line.split()[1:2] != [vmid]]
        lines += [f"{address} {vmid} {pid_placeholder}" for address in reserved]
        self._write_reservations(lines)
        return reserved

    def _look_at_real_pci(self, vmid: str) -> list[str]:
        found = []
        for key, value in sorted(self.settings("qm", vmid).items()):
            if not re.fullmatch(r"hostpci\d+", key):
                continue
            for text in self._host_ids(key, value, vmid):
                prefix = text if text.count(":") == 2 else f"0000:{text}"
                for entry in sorted(os.listdir("/sys/bus/pci/devices")):
                    if entry.startswith(prefix):
                        link = Path("/sys/bus/pci/devices", entry, "driver")
                        driver = os.path.basename(os.readlink(link)) if link.exists() else "none"
                        self.log(f"qemu-server finds {entry} on {driver}")
                        found.append(entry)
        return found

    def _host_ids(self, key: str, value: str, vmid: str) -> list[str]:
        parts = dict(
            part.split("=", 1) if "=" in part else ("host", part)
            for part in value.split(",")
            if part
        )
        if "host" in parts:
            return parts["host"].split(";")
        mapping = self.root / "pve" / "mapping" / "pci.cfg"
        node = (self.root / "nodename").read_text().strip()
        section, paths = None, []
        for line in mapping.read_text().splitlines():
            if line and not line[0].isspace():
                section = line.strip()
            elif section == parts.get("mapping") and line.split()[:1] == ["map"]:
                entry = dict(item.split("=", 1) for item in line.split(None, 1)[1].split(","))
                if entry.get("node") == node:
                    paths.append(entry["path"].split(";"))
        if not paths:
            raise Failed(f"PCI device mapping not found for '{parts.get('mapping')}'")
        # choose_hostpci_devices: the first entry no other live VM has reserved.
        for ids in paths:
            if not any(self._reserved_by_other(text, vmid) for text in ids):
                return ids
        raise Failed(f"could not find a free device for '{key}'")

    def _reserved_by_other(self, text: str, vmid: str) -> bool:
        for line in self._reservations().splitlines():
            pci, owner, kind_value = line.split()
            kind, _, number = kind_value.partition(":")
            if owner == vmid or not pci.startswith(
                text if text.count(":") == 2 else f"0000:{text}"
            ):
                continue
            if kind == "time" and int(number) > time.time():
                return True
            if kind == "pid" and Path(f"/proc/{number}").exists():
                return True
        return False

    def _reservations(self) -> str:
        try:
            return (self.root / "run" / "qemu-server" / "pci-id-reservations").read_text()
        except OSError:
            return ""

    def _write_reservations(self, lines: list[str]) -> None:
        path = self.root / "run" / "qemu-server" / "pci-id-reservations"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{line}\n" for line in lines))

    def unreserve(self, vmid: str) -> None:
        lines = [line for line in self._reservations().splitlines() if line.split()[1:2] != [vmid]]
        self._write_reservations(lines)

    # -- commands ------------------------------------------------------------------------

    def status(self, kind: str, vmid: str) -> int:
        if not self.conf_path(kind, vmid).exists():
            where = "qemu-server" if kind == "qm" else "lxc"
            raise Failed(f"Configuration file 'nodes/standin/{where}/{vmid}.conf' does not exist")
        print(f"status: {'running' if self.pid(kind, vmid) else 'stopped'}")
        return 0

    def start(self, kind: str, vmid: str) -> int:
        self.log(f"{kind} start {vmid}")
        if not self.conf_path(kind, vmid).exists():
            raise Failed(f"Configuration file for {vmid} does not exist")
        with self.locked(kind, vmid):
            if self.pid(kind, vmid):
                raise Failed(f"{'VM' if kind == 'qm' else 'CT'} {vmid} already running")
            self.apply_pending(kind, vmid)
            self.hookscript(kind, vmid, "pre-start", stop_on_error=True)
            if kind == "qm":
                self.prepare_pci(vmid, f"time:{int(time.time()) + 30}")
            if (self.root / "run" / f"{vmid}.fail-start").exists():
                # QEMU does not come up: vm_start_nolock cleans up its PCI reservations
                # and dies; no post-stop runs (no QEMU ever ended).
                if kind == "qm":
                    self.unreserve(vmid)
                raise Failed("start failed: QEMU exited with code 1")
            pid = self.launch(kind, vmid)
            if kind == "qm":
                reserved = [
                    line.split()[0]
                    for line in self._reservations().splitlines()
                    if line.split()[1:2] == [vmid]
                ]
                self.unreserve(vmid)
                lines = self._reservations().splitlines()
                self._write_reservations(lines + [f"{a} {vmid} pid:{pid}" for a in reserved])
            # vm_start_nolock runs post-start last, still under vm_start's lock.
            self.hookscript(kind, vmid, "post-start")
        self.log(f"{kind} start {vmid} done")
        return 0

    def stop(self, kind: str, vmid: str, *, shutdown: bool, timeout: int, force: bool) -> int:
        self.log(f"{kind} {'shutdown' if shutdown else 'stop'} {vmid}")
        with self.locked(kind, vmid):
            pid = self.pid(kind, vmid)
            if pid is None:
                return 0
            self.hookscript(kind, vmid, "pre-stop")
            (self.root / "run" / f"{vmid}.stopping").touch()
            os.kill(pid, signal.SIGTERM if shutdown else signal.SIGKILL)
            if not self._gone(kind, vmid, timeout if shutdown else 10):
                if not force:
                    raise Failed("VM quit/powerdown failed - got timeout")
                print("VM still running - terminating now with SIGKILL", file=sys.stderr)
                os.kill(pid, signal.SIGKILL)
                self._gone(kind, vmid, 10)
            self.pidfile(kind, vmid).unlink(missing_ok=True)
            if kind == "qm":
                self.unreserve(vmid)
            self.apply_pending(kind, vmid)
        self.log(f"{kind} stop {vmid} done")
        return 0

    def _gone(self, kind: str, vmid: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.pid(kind, vmid) is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def cleanup(self, kind: str, vmid: str, clean: bool) -> int:
        """`qm cleanup` (and a container's post-stop): under the lock, after the process
        ended; post-stop runs here, however the guest ended."""
        self.log(f"{kind} cleanup {vmid} begin clean={int(clean)}")
        try:
            if not self.conf_path(kind, vmid).exists():
                return 0
            with self.locked(kind, vmid, CLEANUP_LOCK_WAIT):
                if self.pid(kind, vmid):
                    raise Failed("vm still running")
                if not clean:
                    self.pidfile(kind, vmid).unlink(missing_ok=True)
                    if kind == "qm":
                        self.unreserve(vmid)
                self.hookscript(kind, vmid, "post-stop")
            return 0
        finally:
            self.log(f"{kind} cleanup {vmid} end")


def main(argv: list[str]) -> int:
    root, kind, command, *rest = argv
    pve = Pve(Path(root))
    try:
        if kind == "watch":
            pve.watch(command, rest[0])
            return 0
        vmid = rest[0] if rest else ""
        if not re.fullmatch(r"[1-9][0-9]{2,8}", vmid):
            raise Failed(f"400 Parameter verification failed.\nvmid: invalid format - {vmid!r}")
        options = dict(zip(rest[1::2], rest[2::2], strict=False))
        if command == "status":
            return pve.status(kind, vmid)
        if command == "start":
            return pve.start(kind, vmid)
        if command in ("shutdown", "stop"):
            timeout = int(options.get("--timeout", SHUTDOWN_DEFAULT))
            force = command == "stop" or options.get("--forceStop") in ("1", "on", "yes", "true")
            return pve.stop(
                kind, vmid, shutdown=command == "shutdown", timeout=timeout, force=force
            )
        if command == "cleanup":
            return pve.cleanup(kind, vmid, clean=rest[1:2] == ["1"])
        raise Failed(f"unknown command '{kind} {command}'")
    except Failed as error:
        print(error, file=sys.stderr)
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
