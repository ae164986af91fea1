"""Runs INSIDE the systemd guest: the GPU that drives the screen, passed through by a
real libvirtd and given back (issue 19's Proof; judged by test_desktop.py).

The guest's desktop is the one sysguest.py brings up: weston as
display-manager.service (charly-weston.service) in a real logind session on
seat0/tty7, holding bochs-drm's card0, fbcon on bochs-drm's framebuffer.  A real
libvirtd (its units left to a scenario by `Spec.libvirt`, started here with the
chain's configuration: the installed hook in qemu.d, QEMU as root) runs the nested
TCG domain chain-a, whose two managed hostdevs are the pair 00:02.0 + 00:02.1.

- screen_setup: the desktop up (the display manager started again: the units
  test's `desktop` scenario stopped it), libvirtd started, the domains defined;
- screen_refused: the default policy; `virsh start` refused, naming the unit and
  the session, the desktop untouched;
- screen_release: `screen = "release"`; the session and the display manager stop,
  the console is released, the nested QEMU holds both functions on vfio-pci,
  logind lists the arbiter's sleep lock; `virsh destroy` brings the pair home,
  fbcon back, the display manager active and weston holding card0 again, no lock;
- screen_crash_claim / screen_crash_release: the arbiter killed (SIGKILL, its own
  crash points) at each step of the claim and of the release that comes after
  something was stopped and leaves a state of its own (CLAIM_POINTS_AFTER_STOPS,
  RELEASE_POINTS), then `charly-arbiter restore`: the same end state;
- screen_dm_fails: a display manager made to fail at start (a drop-in, added while
  the VM runs, whose ExecStartPre fails, with Restart=always as gdm has it): the
  release ends on a text login (a getty, with getty@tty1 stopped before as a
  display manager's Conflicts= stops it), the display manager not left
  restart-looping, the failure in `charly-arbiter history`; then the way back
  (the drop-in gone, `charly-arbiter restore`);
- screen_teardown: everything as the units test's next scenarios expect it (its
  configuration, no display manager, no libvirtd, getty@tty1 running).

Like every scenario of sysrunner.py, nothing here asserts: each step records the
facts (drivers, the ledger, I1-I3 with the display manager as a holder that runs
unless a lease records it, the desktop as systemd and logind tell it) and its time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import fields
from pathlib import Path
from typing import Any

import chain
import sysfacts
from libvirt_units import LIBVIRT_UNITS
from sysfacts import GPU, card_holders, cli, systemctl, wait_for

DM = "display-manager.service"
WESTON = "charly-weston.service"  # sysguest.DISPLAY_UNIT: what display-manager.service is
# The display manager as a holder: its real unit's name, not the alias
DM_REF = f"display-manager:{WESTON}"
GETTY = "getty@tty1.service"  # the text login every boot of this guest starts
VM = "chain-a"  # chain.define_domains: the pair as two managed='yes' hostdevs
CONFIG = Path("/etc/charly-arbiter/arbiter.toml")
SAVED = Path("/run/charly-desktop/arbiter.toml.units")  # the units test's configuration
FAILING = Path(f"/etc/systemd/system/{WESTON}.d/charly-fails.conf")
# A display manager that cannot start, looping as gdm's Restart=always would loop.
FAILING_DROPIN = """[Unit]
StartLimitIntervalSec=0

[Service]
ExecStartPre=/bin/false
Restart=always
RestartSec=1
"""
# Kill points of the claim after its first stop (acquire.stop#1 comes before any: the
# simulated host covers it, with the intent), and the release's: each leaves the host
# in a state of its own.  release.sleep and release.switch are left to the simulated
# host and the explorer: they leave what release.intent leaves (the pair on vfio-pci,
# the display manager stopped), with the sleep lock held (release.sleep) or let go
# just before (release.switch); a kill point costs this suite a claim and a restore,
# a quarter to half a minute.
CLAIM_POINTS_AFTER_STOPS = ("acquire.switch", "acquire.sleep", "acquire.active")
RELEASE_POINTS = ("release.intent", "release.start", "release.restored")
SCENARIO_SECONDS = {"screen_crash_claim": 420, "screen_crash_release": 480}
BACK_SECONDS = 150  # the display manager back, weston holding card0 (TCG, one vCPU)


def config(screen: str | None, grace: float = 2, claim_grace: float = 120) -> str:
    """The test's configuration: the pair is the token `gpu`; `screen` the policy
    (None: the default), `grace` the session's warning (screen_grace), `claim_grace`
    how long an active lease whose claimant does not run is not yet stranded.
    Timeouts this version does not know are left out (the record says which were
    written)."""
    from charly_arbiter.core.config import Timeouts

    known = {field.name for field in fields(Timeouts)}
    timeouts = {
        "lock_wait": 60,
        "holder_stop": 60,
        "holder_start": 90,
        "driver_switch": 15,
        "libvirt_call": 60,
        "claim_grace": claim_grace,
        "screen_grace": grace,
        "screen_back": 90,
    }
    lines = [
        "# tests/kernel/desktop_scenarios.py",
        f'hook_log = "{chain.HOOK_LOG}"',
        'device_holder_policy = "refuse"',
    ]
    if screen is not None:
        lines.append(f'screen = "{screen}"')
    lines += ["", "[timeouts]"]
    lines += [f"{key} = {value}" for key, value in timeouts.items() if key in known]
    lines += ["", "[tokens.gpu]", f'address = "{GPU}"', ""]
    return "\n".join(lines)


def configure(s: Any, screen: str | None, grace: float = 2, claim_grace: float = 120) -> None:
    text = config(screen, grace, claim_grace)
    CONFIG.write_text(text)
    s.out.setdefault("configs", []).append(text)


# -- facts -----------------------------------------------------------------------------


def weston_holds_card() -> bool:
    return any(holder["comm"] == "weston" for holder in card_holders())


def wayland_sessions() -> list[dict[str, str]]:
    return [x for x in sysfacts.sessions() if x.get("Type") == "wayland"]


def desktop_back() -> bool:
    """The display manager active, weston holding card0 in an active wayland session."""
    return (
        sysfacts.active(DM)
        and weston_holds_card()
        and any(x.get("Active") == "yes" for x in wayland_sessions())
    )


def screen_use() -> dict[str, Any]:
    """What the arbiter's local host says of the token's screen (Host.screen), and the
    words `detect`, `explain` and the refusal use."""
    from charly_arbiter.compose import open_host, token_catalogue
    from charly_arbiter.core.config import load_config

    configured = load_config(CONFIG)
    host = open_host(configured)
    try:
        [spec] = token_catalogue(configured).resolve(["gpu"])
        use = host.screen(spec)
        return {**use.as_json(), "describe": use.describe()}
    finally:
        host.close()


def gettys() -> list[str]:
    """The text logins running (getty@ttyN.service)."""
    listed = chain.run(
        [sysfacts.SYSTEMCTL, "list-units", "--state=active", "--no-legend", "--plain", "getty@*"]
    )
    return sorted(line.split()[0] for line in listed["stdout"].splitlines() if line.strip())


def arbiter_locks() -> list[dict[str, Any]]:
    return [lock for lock in sysfacts.inhibitors() if lock.get("who") == "charly-arbiter"]


def inhibit_list() -> str:
    return str(chain.run(["/usr/bin/systemd-inhibit", "--list", "--no-pager"])["stdout"])


def domain() -> dict[str, Any]:
    pid = chain.qemu_pid(VM)
    alive = chain.alive(pid)
    return {
        "state": chain.domain_state(VM),
        "qemu_pid": pid,
        "qemu_alive": alive,
        "qemu_vfio": chain.open_vfio(pid) if alive else [],
    }


def lease_records() -> list[dict[str, Any]]:
    """Each lease with what it records as stopped (holder, step, restored)."""
    from charly_arbiter.core.ledger import Ledger

    found = []
    for lease in Ledger(sysfacts.STATE_DIR).read().leases:
        found.append(
            {
                "claimant": str(lease.claimant),
                "state": str(lease.state),
                "stopped": [
                    {"holder": str(r.holder), "state": str(r.state), "restored": r.restored}
                    for r in lease.stopped
                ],
            }
        )
    return found


def step(s: Any, label: str, **extra: Any) -> dict[str, Any]:
    """The runner's facts (drivers, ledger, I1-I3, the watched units) and the desktop."""
    recorded: dict[str, Any] = s.step(
        label,
        desktop=sysfacts.desktop(),
        leases=lease_records(),
        domain=domain(),
        finishing=chain.finish_release_running(),
        **extra,
    )
    return recorded


def timed(s: Any, name: str, began: float) -> float:
    seconds = round(time.monotonic() - began, 2)
    s.out.setdefault("seconds", {})[name] = seconds
    return seconds


def wait(s: Any, name: str, predicate: Callable[[], bool], seconds: float) -> bool:
    """Wait for `predicate`, recording how long it took (None: it never held)."""
    began = time.monotonic()
    held = wait_for(predicate, seconds, step=0.5)
    s.out.setdefault("waits", {})[name] = round(time.monotonic() - began, 2) if held else None
    return held


class StartFailed(Exception):
    """`virsh start` failed where the scenario needs the VM running: waiting for what
    follows would only spend the suite's minutes (the runner records this, and the
    tests show it)."""


def started(result: dict[str, Any]) -> None:
    if result["rc"] != 0:
        raise StartFailed(f"virsh start {VM} exited {result['rc']}: {result['stderr'].strip()}")


def released() -> bool:
    """No detached release at work, the pair home."""
    return not chain.finish_release_running() and sysfacts.drivers() == sysfacts.HOME


# -- the desktop, libvirtd, and a clean slate -------------------------------------------------


def watch(s: Any) -> None:
    s.watch(DM, GETTY, "libvirtd.service", "systemd-logind.service")
    s.expect(DM_REF)


def ensure_desktop(s: Any, label: str) -> None:
    """The desktop up, no VM, no lease (what a scenario before may have left): a
    scenario starts from the same place whatever the one before did."""
    if chain.domain_state(VM) == "running":
        s.out.setdefault("cleanup", []).append(chain.virsh("destroy", VM))
    wait_for(released, 60)
    if sysfacts.ledger()["leases"]:
        s.out.setdefault("cleanup", []).append(cli("restore"))
    if not desktop_back():
        s.out.setdefault("cleanup", []).append(systemctl("start", DM, timeout=180))
    s.out.setdefault("ready", {})[label] = wait_for(desktop_back, BACK_SECONDS, step=0.5)


def scenario_screen_setup(s: Any) -> None:
    """The display manager started again, libvirtd started by systemd, chain-a defined."""
    watch(s)
    SAVED.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIG, SAVED)
    configure(s, None)
    began = time.monotonic()
    s.out["dm_start"] = systemctl("start", DM, timeout=180)
    wait(s, "desktop_up", desktop_back, BACK_SECONDS)
    timed(s, "dm_start", began)
    began = time.monotonic()
    sysfacts.start_libvirtd(s.out)
    timed(s, "libvirtd", began)
    step(s, "up")
    began = time.monotonic()
    s.out["screen"] = screen_use()
    timed(s, "screen_use", began)
    s.out["detect"] = cli("detect")
    s.out["explain"] = cli("explain", "gpu")


def scenario_screen_refused(s: Any) -> None:
    """The default policy: the start is refused, naming the display manager's unit and
    the session, and nothing on the desktop moves."""
    watch(s)
    configure(s, None)
    ensure_desktop(s, "before")
    before = step(s, "before")
    began = time.monotonic()
    s.out["start"] = chain.virsh("start", VM)
    timed(s, "refused_start", began)
    s.out["sessions_before"] = [x.get("Id") for x in before["desktop"]["sessions"]]
    s.out["dm_pid_before"] = before["units"][DM]["MainPID"]
    step(s, "refused")


def scenario_screen_release(s: Any) -> None:
    """`screen = "release"`: the start stops the session and the display manager,
    releases the console and passes both functions to the nested QEMU, with a sleep
    lock held; the destroy gives them back."""
    watch(s)
    configure(s, "release")
    ensure_desktop(s, "before")
    before = step(s, "before")
    s.out["sessions_before"] = [x.get("Id") for x in before["desktop"]["sessions"]]
    began = time.monotonic()
    s.out["start"] = chain.virsh("start", VM)
    timed(s, "start_to_running", began)
    started(s.out["start"])
    wait(s, "qemu_holds_vfio", lambda: bool(domain()["qemu_vfio"]), 30)
    step(s, "running", inhibit_list=inhibit_list())
    LAST_CLAIM[:] = lease_records()
    s.out["status"] = cli("status")
    began = time.monotonic()
    s.out["destroy"] = chain.virsh("destroy", VM)
    timed(s, "destroy", began)
    wait(s, "pair_home", released, 60)
    timed(s, "destroy_to_home", began)
    wait(s, "desktop_back", desktop_back, BACK_SECONDS)
    timed(s, "destroy_to_desktop", began)
    wait(s, "lock_gone", lambda: not arbiter_locks(), 30)
    step(s, "back", inhibit_list=inhibit_list())
    s.out["history"] = cli("history", "--claimant", f"libvirt:{VM}")


@contextmanager
def claimant() -> Iterator[subprocess.Popen[bytes]]:
    """A process to claim for (as a VM's QEMU would be), killed afterwards."""
    process = subprocess.Popen(["/usr/bin/sleep", "900"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def stop_points() -> list[str]:
    """acquire.stop#N for each stop after the first, as many as the release
    scenario's claim recorded (two when it did not run: the session, the display
    manager)."""
    stops = 2
    for lease in LAST_CLAIM:
        stops = len(lease["stopped"])
    return [f"acquire.stop#{n}" for n in range(2, stops + 1)]


LAST_CLAIM: list[dict[str, Any]] = []  # the leases the release scenario's claim recorded


def crash_and_restore(s: Any, point: str, release: bool) -> None:
    """Claim (and, for a point of the release, release) with the arbiter killed at
    `point`; the claimant gone; `restore`; the desktop back."""
    ensure_desktop(s, point)
    record: dict[str, Any] = {}
    s.out.setdefault("points", {})[point] = record
    crash = {"CHARLY_ARBITER_CRASH_AT": point}
    began = time.monotonic()
    with claimant() as process:
        me = f"process:{process.pid}"
        record["claimant"] = me
        if release:
            record["acquire"] = cli("acquire", "--exclusive", me, "gpu")
            record["release"] = cli("release", "--force", me, env=crash)
        else:
            record["acquire"] = cli("acquire", "--exclusive", me, "gpu", env=crash)
        step(s, f"killed at {point}")
    time.sleep(1)  # claim_grace: an active lease's claimant gone for longer is stranded
    restoring = time.monotonic()
    record["restore"] = cli("restore")
    wait_for(released, 60)
    record["back"] = wait_for(desktop_back, BACK_SECONDS, step=0.5)
    wait_for(lambda: not arbiter_locks(), 30)
    record["seconds"] = round(time.monotonic() - began, 2)
    record["restore_to_desktop"] = round(time.monotonic() - restoring, 2)
    step(s, f"restored after {point}")


def scenario_screen_crash_claim(s: Any) -> None:
    watch(s)
    # a killed claim's claimant is gone at once: stranded, not a VM about to start
    configure(s, "release", grace=0.5, claim_grace=1)
    s.out["points_order"] = [*stop_points(), *CLAIM_POINTS_AFTER_STOPS]
    for point in s.out["points_order"]:
        crash_and_restore(s, point, release=False)


def scenario_screen_crash_release(s: Any) -> None:
    watch(s)
    # a killed claim's claimant is gone at once: stranded, not a VM about to start
    configure(s, "release", grace=0.5, claim_grace=1)
    s.out["points_order"] = list(RELEASE_POINTS)
    for point in RELEASE_POINTS:
        crash_and_restore(s, point, release=True)


def scenario_screen_dm_fails(s: Any) -> None:
    """The display manager cannot start again (a drop-in added while the VM runs): the
    release ends on a text login on tty1, the display manager not left looping, the
    failure in the history; with the drop-in gone, `restore` brings the desktop back."""
    watch(s)
    configure(s, "release")
    ensure_desktop(s, "before")
    # On a real desktop host the display manager's unit conflicts with the getty on
    # its console (gdm's Conflicts=getty@tty1.service): no text login runs.
    s.out["getty_stop"] = systemctl("stop", GETTY)
    s.out["gettys_before"] = gettys()
    step(s, "before")
    s.out["start"] = chain.virsh("start", VM)
    started(s.out["start"])
    FAILING.parent.mkdir(parents=True, exist_ok=True)
    FAILING.write_text(FAILING_DROPIN)
    s.out["reload"] = systemctl("daemon-reload")
    step(s, "running")
    since = sysfacts.uptime()
    began = time.monotonic()
    s.out["destroy"] = chain.virsh("destroy", VM)
    wait(s, "pair_home", released, 60)
    wait(s, "text_login", lambda: bool(gettys()), BACK_SECONDS)
    timed(s, "destroy_to_text_login", began)
    wait_for(lambda: not chain.finish_release_running(), 60)
    first = sysfacts.unit(DM)
    time.sleep(5)  # a looping unit would restart (RestartSec=1) meanwhile
    s.out["gettys_after"] = gettys()
    step(
        s,
        "text_login",
        dm_first=first,
        dm_journal=sysfacts.journal_of(WESTON, since),
        gettys=gettys(),
    )
    s.out["history"] = cli("history", "--claimant", f"libvirt:{VM}")
    s.out["history_json"] = cli("history", "--json", "--claimant", f"libvirt:{VM}")
    s.out["explain"] = cli("explain", "gpu")
    s.out["explain_claimant"] = cli("explain", f"libvirt:{VM}")
    s.out["status"] = cli("status")
    # The way back: the display manager mended, then restore.
    FAILING.unlink()
    s.out["reload_back"] = systemctl("daemon-reload")
    began = time.monotonic()
    s.out["restore"] = cli("restore")
    wait(s, "desktop_after_restore", desktop_back, BACK_SECONDS)
    timed(s, "restore_to_desktop", began)
    step(s, "mended")


def scenario_screen_teardown(s: Any) -> None:
    """Back to what the units test's next scenarios expect: its configuration, no
    lease, no VM, no display manager, no libvirtd, getty@tty1 running."""
    s.watch(DM, GETTY, "libvirtd.service")
    if chain.domain_state(VM) == "running":
        s.out["destroy"] = chain.virsh("destroy", VM)
    wait_for(released, 60)
    with suppress(FileNotFoundError):
        FAILING.unlink()
        systemctl("daemon-reload")
    if sysfacts.ledger()["leases"]:
        s.out["restore"] = cli("restore")
    if sysfacts.ledger()["poisoned"]:
        s.out["clear"] = cli("poison", "clear", "gpu")
    s.out["stop"] = systemctl("stop", DM, *sorted(LIBVIRT_UNITS), timeout=180)
    systemctl("reset-failed", DM)
    others = [getty for getty in gettys() if getty != GETTY]
    if others:
        s.out["gettys_stopped"] = systemctl("stop", *others)
    if not sysfacts.active(GETTY):
        s.out["getty"] = systemctl("start", GETTY)
    if SAVED.exists():
        shutil.copy(SAVED, CONFIG)
    os.sync()
    wait_for(lambda: not card_holders(), 30)
    s.step("clean", desktop=sysfacts.desktop())
