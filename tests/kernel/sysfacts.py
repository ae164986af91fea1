"""Runs INSIDE the systemd guest: what systemd, logind, the console and the card say.

The facts a scenario (and the runner's evidence) is made of, each read the way
an operator would, as plain values for JSON: a unit's state (`systemctl
show`), its journal, who holds /dev/dri/card0 (the /proc scan `fuser` does,
with each process's unit from its cgroup), logind's sessions, seats and
inhibitors (over D-Bus with `busctl --json`), the virtual consoles (is fbcon
bound), when the boot reached its targets, and the arbiter's ledger with the
invariants I1-I3 (tests/invariants.py).  The drivers, the ledger and the
small helpers are chain.py's (the same guest kernel and pair).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import chain
from chain import AUDIO, CLI, GPU, HOME, STATE_DIR, drivers, ledger, run, vfio_nodes, wait_for
from invariants import HostFacts, violations

from charly_arbiter.core.ledger import Ledger

__all__ = ["AUDIO", "CLI", "GPU", "HOME", "STATE_DIR", "drivers", "ledger", "vfio_nodes"]
__all__ += ["wait_for"]

SYSTEMCTL = "/usr/bin/systemctl"
JOURNALCTL = "/usr/bin/journalctl"
LOGINCTL = "/usr/bin/loginctl"
BUSCTL = "/usr/bin/busctl"
CARD = "/dev/dri/card0"
TOKEN = "gpu"
UNIT_PROPERTIES = (
    "ActiveState",
    "SubState",
    "Result",
    "MainPID",
    "ExecMainStatus",
    "NRestarts",
    "UnitFileState",
)
SESSION_PROPERTIES = (
    "Id",
    "Name",
    "User",
    "Type",
    "Class",
    "Seat",
    "VTNr",
    "TTY",
    "Active",
    "State",
    "Service",
    "Leader",
    "Scope",
    "Remote",
)


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def say(line: str) -> None:
    """A progress line on the serial console (the runner's stdout is ttyS0)."""
    print(f"charly-runner t={uptime():.1f} {line}", flush=True)


def show(unit: str | None, properties: Collection[str]) -> dict[str, str]:
    """`systemctl show` of `unit` (the manager itself when None), as a dict."""
    argv = [SYSTEMCTL, "show"]
    for name in properties:
        argv += ["-p", name]
    if unit is not None:
        argv += ["--", unit]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return dict(line.partition("=")[::2] for line in result.stdout.splitlines() if "=" in line)


def unit(name: str, properties: Collection[str] = UNIT_PROPERTIES) -> dict[str, str]:
    return show(name, properties)


def units(
    names: Collection[str], properties: Collection[str] = UNIT_PROPERTIES
) -> dict[str, dict[str, str]]:
    """`unit` of each of `names`, in one `systemctl show` (each one costs this guest a
    good part of a second)."""
    if not names:
        return {}
    argv = [SYSTEMCTL, "show", "-p", "Id", *(f"-p{name}" for name in properties), "--", *names]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    blocks = [block for block in result.stdout.split("\n\n") if block.strip()]
    shown = [
        dict(line.partition("=")[::2] for line in block.splitlines() if "=" in line)
        for block in blocks
    ]
    # systemctl shows them in the order asked (Id is the unit's own name, aliases resolved)
    return {
        name: {k: v for k, v in found.items() if k in properties}
        for name, found in zip(names, shown, strict=True)
    }


def active(name: str) -> bool:
    return run([SYSTEMCTL, "is-active", "--quiet", "--", name])["rc"] == 0


def systemctl(*args: str, timeout: float = 120) -> dict[str, Any]:
    return run([SYSTEMCTL, *args], timeout=timeout)


def journal(name: str | None, lines: int = 40, scope: str = "-u") -> list[str]:
    """The last lines of this boot's journal (of unit `name`, or all of it)."""
    argv = [JOURNALCTL, "-b", "--no-pager", "-o", "short-monotonic", "-n", str(lines)]
    if name is not None:
        argv += [scope, name]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.splitlines()


def journal_of(name: str, since: float = 0) -> list[str]:
    """The messages (only) unit `name` logged this boot, from uptime `since` on."""
    return journals_of([name], since)[name]


def journals_of(names: Collection[str], since: float = 0) -> dict[str, list[str]]:
    """`journal_of` for each of `names`, from one `journalctl` (as `-u` matches: what the
    unit logged, and what systemd logged about it)."""
    argv = [JOURNALCTL, "-b", "--no-pager", "-o", "json"]
    for name in names:
        argv += ["-u", name]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    found: dict[str, list[str]] = {name: [] for name in names}
    for line in result.stdout.splitlines():
        entry = json.loads(line)
        at = int(entry.get("__MONOTONIC_TIMESTAMP", 0)) / 1e6
        message = entry.get("MESSAGE")
        if at < since or not isinstance(message, str):
            continue
        for key in ("_SYSTEMD_UNIT", "UNIT"):
            if entry.get(key) in found:
                found[entry[key]].append(message)
                break
    return found


def failed_units() -> list[str]:
    result = run([SYSTEMCTL, "list-units", "--failed", "--no-legend", "--plain", "--no-pager"])
    return [line.split()[0] for line in result["stdout"].splitlines() if line.strip()]


def cgroup_of(pid: int) -> str:
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition("::")[2] for line in lines if line.startswith("0::")), "")


def unit_of(pid: int) -> str:
    """The unit (service or scope) whose cgroup `pid` runs in, as `ps -o unit` says."""
    parts = [part for part in cgroup_of(pid).split("/") if part.endswith((".service", ".scope"))]
    return parts[-1] if parts else ""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def card_holders(node: str = CARD) -> list[dict[str, Any]]:
    """Every process with `node` open (what `fuser -v NODE` lists), with its unit."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target == node:
                pid = int(entry.name)
                found.append({"pid": pid, "comm": comm(pid), "unit": unit_of(pid)})
                break
    return sorted(found, key=lambda holder: int(holder["pid"]))


def holds(pid: int | str, node: str = CARD) -> bool:
    return any(int(holder["pid"]) == int(pid) for holder in card_holders(node))


def busctl_json(*args: str) -> Any:
    result = subprocess.run(
        [BUSCTL, "--json=short", "call", "org.freedesktop.login1", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:
        return {"error": result.stderr.strip()}
    return json.loads(result.stdout)["data"]


def sessions() -> list[dict[str, str]]:
    """logind's sessions, each with the properties `loginctl show-session` gives."""
    listed = busctl_json(
        "/org/freedesktop/login1", "org.freedesktop.login1.Manager", "ListSessions"
    )
    if isinstance(listed, dict):
        return [listed]
    found = []
    for session_id, *_ in listed[0]:
        result = subprocess.run(
            [LOGINCTL, "show-session", session_id, *(f"-p{p}" for p in SESSION_PROPERTIES)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        found.append(
            dict(line.partition("=")[::2] for line in result.stdout.splitlines() if "=" in line)
        )
    return found


def seat(name: str = "seat0") -> dict[str, str]:
    result = subprocess.run(
        [LOGINCTL, "show-seat", name, "-pActiveSession", "-pCanGraphical", "-pCanTTY"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return dict(line.partition("=")[::2] for line in result.stdout.splitlines() if "=" in line)


def inhibitors() -> list[dict[str, Any]]:
    """logind's inhibitor locks (what `systemd-inhibit --list` prints)."""
    listed = busctl_json(
        "/org/freedesktop/login1", "org.freedesktop.login1.Manager", "ListInhibitors"
    )
    if isinstance(listed, dict):
        return [listed]
    keys = ("what", "who", "why", "mode", "uid", "pid")
    return [dict(zip(keys, row, strict=True)) for row in listed[0]]


def vtconsoles() -> list[dict[str, str]]:
    found = []
    for vtcon in sorted(Path("/sys/class/vtconsole").iterdir()):
        found.append(
            {
                "vtcon": vtcon.name,
                "name": (vtcon / "name").read_text().strip(),
                "bind": (vtcon / "bind").read_text().strip(),
            }
        )
    return found


def fbcon_bound() -> bool | None:
    """Whether fbcon draws on a framebuffer (None: no framebuffer console exists)."""
    for vtcon in vtconsoles():
        if "frame buffer" in vtcon["name"]:
            return vtcon["bind"] == "1"
    return None


def desktop() -> dict[str, Any]:
    """The screen as a whole: the display manager, the sessions, the seat, the card's
    holders, the consoles, the inhibitors."""
    return {
        "display_manager": unit("display-manager.service", (*UNIT_PROPERTIES, "Id")),
        "sessions": sessions(),
        "seat0": seat(),
        "card0": card_holders(),
        "vtconsoles": vtconsoles(),
        "fbcon_bound": fbcon_bound(),
        "active_vt": Path("/sys/class/tty/tty0/active").read_text().strip(),
        "inhibitors": inhibitors(),
    }


def since_kernel_start(usec: str) -> float | None:
    """A monotonic timestamp of systemd's (usec), in seconds; None when never reached."""
    try:
        value = int(usec)
    except ValueError:
        return None
    return round(value / 1e6, 2) if value else None


def boot_facts(switch_root: Path) -> dict[str, Any]:
    """Wait for the boot to finish (`is-system-running --wait`), then say how long each
    stage took, in seconds after the kernel started."""
    waited = time.monotonic()
    state = run([SYSTEMCTL, "is-system-running", "--wait"], timeout=600)["stdout"].strip()
    reached: dict[str, float | None] = {}
    try:
        reached["switch_root"] = float(switch_root.read_text())
    except (OSError, ValueError):
        reached["switch_root"] = None
    reached["systemd"] = since_kernel_start(
        show(None, ["UserspaceTimestampMonotonic"]).get("UserspaceTimestampMonotonic", "")
    )
    for target in ("sysinit.target", "basic.target", "multi-user.target", "graphical.target"):
        stamp = show(target, ["ActiveEnterTimestampMonotonic"])["ActiveEnterTimestampMonotonic"]
        reached[target] = since_kernel_start(stamp)
    return {
        "state": state,
        "waited": round(time.monotonic() - waited, 2),
        "runner_at": uptime(),
        "reached": reached,
        "failed": failed_units(),
        "cpus": os.cpu_count(),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
    }


def cli(*args: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The installed `charly-arbiter` (the default configuration and state directory)."""
    environment = None if env is None else {**os.environ, **env}
    return run([CLI, *args], env=environment)


def invariant_violations(running: Mapping[str, bool], expected: Collection[str]) -> list[str]:
    """I1-I3 over the pair (token `gpu`) and the holders a scenario watches, and I6
    over the sleep locks the real systemd holds (their transient units)."""
    from charly_arbiter.host.inhibit import SleepLocks

    facts = HostFacts(
        drivers=drivers(),
        token_functions={TOKEN: [GPU, AUDIO]},
        running=dict(running),
        expected_running=frozenset(expected),
        sleep_locks=SleepLocks(Path("/run"), 60, 60).inhibitors(),
    )
    return violations(Ledger(STATE_DIR).read(), facts)


def start_libvirtd(out: dict[str, Any]) -> None:
    """libvirtd as systemd runs it (a spec with `libvirt`: its units are there, not
    started at boot): the chain's configuration (chain.configure_libvirt: the installed
    hook, QEMU as root, the observer hook), then `systemctl start libvirtd.service`
    (virtlogd comes by its socket), and the chain's domains defined (chain-a, chain-b
    with managed='yes', chain-n with managed='no', each passing the pair through)."""
    chain.configure_libvirt()
    out["libvirtd"] = systemctl("start", "libvirtd.service", timeout=300)
    out["answered"] = run(["/usr/bin/virsh", "-c", chain.URI, "version"], timeout=120)
    chain.define_domains(out)
