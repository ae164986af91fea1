"""A real libvirtd with the real hook: the test bed of tests/libvirt (its fixtures are
conftest.py's) and of bench/bench_costs.py.

`libvirt_environment` takes an exclusive flock on /tmp/charly-libvirt.lock
(the package tests use libvirtd and /etc/libvirt too), appends the qemu.conf
settings these machines need, installs the hook into
/etc/libvirt/hooks/qemu.d/charly-arbiter *before* starting virtlogd and
libvirtd itself (CI has no systemd), and restores every file it touched at
the end.  The PCI side is a simulated host (`sim:DIR` with
`real_holders = ["libvirt"]`); the VMs are real QEMU/TCG domains, 64 MiB and
no disk, whose claims come from the charly-arbiter metadata element.

The CLI under test is the checkout's (`python -m charly_arbiter`, through a
wrapper the hook execs) unless CHARLY_ARBITER_E2E_INSTALLED=1, in which case
it is the installed /usr/bin/charly-arbiter and the installed hook.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handoffs import detached_pids, wait_for_handoffs
from machine import INSTALLED, REPO, HookedService, Unavailable, flocked, restored, run
from simhosts import audio, gpu, host

from charly_arbiter.host.sim import SimHost

LOCK = Path("/tmp/charly-libvirt.lock")
ETC_LIBVIRT = Path("/etc/libvirt")
HOOK_DIR = ETC_LIBVIRT / "hooks" / "qemu.d"
HOOK = HOOK_DIR / "charly-arbiter"
QEMU_CONF = ETC_LIBVIRT / "qemu.conf"
INSTALLED_CONFIG = Path("/etc/charly-arbiter/arbiter.toml")
RUN = Path("/run")
URI = "qemu:///system"
PREFIX = "ca-e2e-"
NAMESPACE = "https://charly-arbiter.org/xmlns/claim/1"
QEMU_SETTINGS = """
# charly-arbiter e2e tests: run QEMU as root without cgroups, labels or namespaces
user = "root"
group = "root"
cgroup_controllers = [ ]
security_driver = "none"
namespaces = [ ]
"""
PROGRAMS = {
    "libvirtd": "/usr/sbin/libvirtd",
    "virtlogd": "/usr/sbin/virtlogd",
    "virsh": "/usr/bin/virsh",
    "qemu": "/usr/bin/qemu-system-x86_64",
}

# PCI side simulated, libvirt domains real.
HOST_TOML = host(
    gpu("0000:0a:00.0", group=12),
    audio("0000:0a:00.1", group=12),
    gpu("0000:0b:00.0", group=13, model="2204"),
    real_holders=["libvirt"],
)

CONFIG = """
host = "sim:{sim}"
state_dir = "{state}"
libvirt_uri = "{uri}"
libvirt_preemption = "{preemption}"
hook_log = "{hook_log}"

[timeouts]
lock_wait = 20
holder_stop = 5
holder_start = 30
driver_switch = 5
libvirt_call = 20
claim_grace = 3

[tokens.gpu0]
address = "0000:0a:00.0"

[tokens.gpu1]
address = "0000:0b:00.0"
home_driver = "nvidia"
"""


def log(message: str) -> None:
    print(f"[libvirt e2e] {message}", file=sys.stderr, flush=True)


@dataclass
class Libvirt(HookedService):
    """The running daemon, the hook's configuration, and helpers for the tests."""

    started_virtlogd: bool = False

    def hook(self, *args: str, stdin: bytes = b"", timeout: float = 60) -> Any:
        """Run the hook program by hand (as libvirt does, with XML on stdin)."""
        return subprocess.run(
            [*self.cli_argv, "hook", *args],
            input=stdin,
            capture_output=True,
            timeout=timeout,
            env=self.env(),
        )

    def ledger_text(self) -> str:
        path = self.state_dir / "ledger.toml"
        return path.read_text() if path.exists() else ""

    def hook_log_lines(self) -> list[tuple[int, str]]:
        """(pid, message) of every line the hooks logged to hook_log so far."""
        text = self.hook_log.read_text() if self.hook_log.exists() else ""
        lines = []
        for line in text.splitlines():
            parts = line.split(" ", 4)
            if len(parts) == 5 and parts[2].isdigit():
                lines.append((int(parts[2]), parts[4]))
        return lines

    def sim_state(self) -> dict[str, Any]:
        """state.json, with the simulation's whole log under `log` (SimHost.snapshot
        without making a state that is not there yet)."""
        path = self.sim_dir / "state.json"
        if not path.exists():
            return {}
        return {**json.loads(path.read_text()), "log": SimHost(self.sim_dir).log()}

    def set_preemption(self, policy: str, extra: str = "") -> None:
        """Write the configuration the hook reads; `extra` is appended (e.g. [[holders]])."""
        self.config_path.write_text(
            CONFIG.format(
                sim=self.sim_dir,
                state=self.state_dir,
                uri=URI,
                preemption=policy,
                hook_log=self.hook_log,
            )
            + extra
        )

    # -- domains ---------------------------------------------------------------------

    def define(self, name: str, claim: str = "") -> str:
        """Define a TCG domain (64 MiB, no disk); `claim` is the metadata element's body."""
        full = PREFIX + name
        metadata = f"<metadata>{claim}</metadata>" if claim else ""
        xml = f"""<domain type='qemu'>
  <name>{full}</name>
  <memory unit='MiB'>64</memory>
  <vcpu>1</vcpu>
  {metadata}
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <on_poweroff>destroy</on_poweroff>
  <devices>
    <emulator>{PROGRAMS["qemu"]}</emulator>
    <serial type='pty'/>
  </devices>
</domain>"""
        path = self.work / f"{full}.xml"
        path.write_text(xml)
        self.virsh("define", str(path))
        return full

    def virsh(self, *args: str, check: bool = True, timeout: float = 90) -> Any:
        return run([PROGRAMS["virsh"], "-c", URI, *args], check=check, timeout=timeout)

    def running(self) -> set[str]:
        out = self.virsh("list", "--name").stdout
        return {line.strip() for line in out.splitlines() if line.strip().startswith(PREFIX)}

    def states(self) -> dict[str, str]:
        """libvirt's own word for the state of every test domain ("running", "shut off",
        "paused", ...), from one `virsh list --all`."""
        out = self.virsh("list", "--all").stdout.splitlines()[2:]
        rows = (line.split(None, 2) for line in out if line.strip())
        return {row[1]: row[2].strip() for row in rows if row[1].startswith(PREFIX)}

    def busy(self) -> list[str]:
        """What still acts on the arbiter's behalf: each item names a process or a domain.

        The detached half of `release` (`_finish-release`) for this state
        directory; a hook or a holder stop/start still marked by a live process
        (STATE_DIR/libvirt-hooks, libvirt-acting); a lease mid-step whose owner
        lives; a test domain between "running" and "shut off".
        """
        from charly_arbiter.core.ledger import Ledger
        from charly_arbiter.core.model import LeaseState

        found = [f"_finish-release pid {pid}" for pid in detached_pids(self.state_dir)]
        for kind in ("libvirt-hooks", "libvirt-acting"):
            for marker in sorted((self.state_dir / kind).glob("*")):
                if pid_alive(marker):
                    found.append(f"{kind}/{marker.name} of a live process")
        for lease in Ledger(self.state_dir).read().leases:
            if lease.state is not LeaseState.ACTIVE and lease.owner_pid:
                with contextlib.suppress(OSError):
                    os.kill(lease.owner_pid, 0)
                    found.append(f"{lease.claimant} {lease.state} by pid {lease.owner_pid}")
        found += [
            f"{name} {state}"
            for name, state in self.states().items()
            if state not in ("running", "shut off")
        ]
        return found

    def settle(self, timeout: float = 60) -> float:
        """Wait until `busy()` is empty; the seconds it took.  Fails after `timeout`."""
        started = time.monotonic()
        while True:
            pending = self.busy()
            if not pending:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise AssertionError(f"not settled after {timeout} s: {', '.join(pending)}")
            time.sleep(0.1)

    def qemu_pid(self, name: str) -> int:
        return int((RUN / "libvirt" / "qemu" / f"{name}.pid").read_text().strip())

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 45) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def clean(self) -> None:
        """No test domain runs or is defined, and the ledger and sim state are fresh."""
        running = pid_alive(RUN / "libvirtd.pid")
        out = self.virsh("list", "--all", "--name").stdout if running else ""
        for name in (line.strip() for line in out.splitlines()):
            if name.startswith(PREFIX):
                self.virsh("destroy", name, check=False)
                self.virsh("undefine", name, "--managed-save", check=False)
        wait_for_handoffs(self.state_dir)  # before wiping the state they work on
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self.state_dir.mkdir(mode=0o700)
        for name in ("state.json", "state.lock", "log.jsonl"):
            (self.sim_dir / name).unlink(missing_ok=True)
        self.set_preemption("stop")

    # -- the daemons -------------------------------------------------------------------

    def start_daemons(self) -> None:
        if not pid_alive(RUN / "virtlogd.pid"):
            run([PROGRAMS["virtlogd"], "-d"])
            self.started_virtlogd = True
        run([PROGRAMS["libvirtd"], "-d"])
        self.wait_for(
            "libvirtd to answer",
            lambda: self.virsh("version", check=False, timeout=10).returncode == 0,
            timeout=30,
        )

    def stop_libvirtd(self) -> None:
        _stop_daemon(RUN / "libvirtd.pid")


def claim(mode: str = "", tokens: tuple[str, ...] = (), **attributes: str) -> str:
    """The charly-arbiter metadata element, as a test domain carries it."""
    attrs = "".join(f' {key}="{value}"' for key, value in attributes.items())
    if mode:
        attrs = f' mode="{mode}"' + attrs
    body = "".join(f"<ca:token>{token}</ca:token>" for token in tokens)
    return f'<ca:claim xmlns:ca="{NAMESPACE}"{attrs}>{body}</ca:claim>'


def pid_alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def _stop_daemon(pidfile: Path) -> None:
    """Stop a daemon this fixture started, by the pid in its pid file."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _session_lock() -> Iterator[None]:
    if os.environ.get("CHARLY_LIBVIRT_LOCK_HELD") == "1":
        # tests/package installed the package and holds the lock around this whole run.
        yield
        return
    with flocked(LOCK, "another libvirt test session"):
        yield


def why_not() -> str | None:
    """Why the real-libvirtd tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "the libvirt end-to-end tests need root"
    missing = [path for path in PROGRAMS.values() if not os.access(path, os.X_OK)]
    if missing:
        return f"missing {', '.join(missing)}: run scripts/setup (scripts/apt-packages.txt)"
    try:
        import libvirt  # noqa: F401
    except ImportError:
        return "python3-libvirt is not importable by this interpreter: run scripts/setup"
    if INSTALLED and not os.access("/usr/bin/charly-arbiter", os.X_OK):
        return "CHARLY_ARBITER_E2E_INSTALLED=1 but /usr/bin/charly-arbiter is not installed"
    return None


@contextlib.contextmanager
def libvirt_environment(work: Path, with_hook: bool = True) -> Iterator[Libvirt]:
    """A running libvirtd (with the hook unless `with_hook` is false) under the session lock.

    Everything it touches under /etc is restored when the block ends; the
    daemons it started are stopped.  Used by the tests and by bench/bench_costs.py.
    """
    os.chmod(work, 0o700)
    sim_dir, state_dir = work / "host", work / "state"
    sim_dir.mkdir(exist_ok=True)
    (sim_dir / "host.toml").write_text(HOST_TOML)
    if INSTALLED:
        cli_argv = ["/usr/bin/charly-arbiter"]
        config_path = INSTALLED_CONFIG
    else:
        wrapper = work / "charly-arbiter"
        config_path = work / "arbiter.toml"
        wrapper.write_text(
            "#!/bin/sh\n"
            f"export CHARLY_ARBITER_CONFIG='{config_path}' PYTHONPATH='{REPO}'\n"
            f"exec '{sys.executable}' -m charly_arbiter \"$@\"\n"
        )
        wrapper.chmod(0o755)
        cli_argv = [sys.executable, "-m", "charly_arbiter"]
    env = Libvirt(work, sim_dir, state_dir, config_path, work / "hook.log", cli_argv)
    with _session_lock():
        if pid_alive(RUN / "libvirtd.pid"):
            raise Unavailable(
                "a libvirtd is already running (see /run/libvirtd.pid): the hook is only "
                "loaded when libvirtd starts, so stop it before running these tests"
            )
        HOOK_DIR.mkdir(parents=True, exist_ok=True)
        config_dir_existed = INSTALLED_CONFIG.parent.exists()
        backups = [QEMU_CONF, HOOK, *([config_path] if INSTALLED else [])]
        with restored(*backups):
            text = QEMU_CONF.read_text() if QEMU_CONF.exists() else ""
            if QEMU_SETTINGS.strip() not in text:
                QEMU_CONF.write_text(text + QEMU_SETTINGS)
            if INSTALLED:
                config_path.parent.mkdir(parents=True, exist_ok=True)
            if not with_hook:
                HOOK.unlink(missing_ok=True)
            elif INSTALLED:
                if not os.access(HOOK, os.X_OK):
                    raise Unavailable(f"the installed package did not install its hook at {HOOK}")
            else:
                hook = (REPO / "hooks" / "qemu").read_text()
                HOOK.write_text(
                    hook.replace("/usr/bin/charly-arbiter", str(work / "charly-arbiter"))
                )
                HOOK.chmod(0o755)
            env.clean()
            what = f"with the hook {HOOK}" if with_hook else "without a hook"
            log(f"starting libvirtd {what} ({'installed' if INSTALLED else 'checkout'} CLI)")
            env.start_daemons()
            try:
                yield env
            finally:
                env.clean()
                env.stop_libvirtd()
                if env.started_virtlogd:
                    _stop_daemon(RUN / "virtlogd.pid")
        if INSTALLED and not config_dir_existed:
            shutil.rmtree(INSTALLED_CONFIG.parent, ignore_errors=True)
