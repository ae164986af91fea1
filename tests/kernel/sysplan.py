"""The systemd guest's one QEMU run, shared by test_systemd_units.py and
test_desktop.py (conftest.py's `systemd_guest`): a boot of its own costs this
suite three minutes, so both test files' scenarios run in the same two boots.

Boot 1 (graphical.target, weston as display-manager.service): the units test's
`desktop` (the desktop as it booted), then the screen scenarios of
desktop_scenarios.py (a real libvirtd, the pair passed through and the desktop
given back; they end with the display manager and libvirtd stopped and the units
test's configuration back), then the rest of unit_scenarios.py, ending in a
power cut mid-claim.  Boot 2 (multi-user.target): the reconcile unit's work.
"""

from __future__ import annotations

from pathlib import Path

import desktop_scenarios
import unit_scenarios
from sysguest import Boot, Spec

RECONCILE = "charly-arbiter-reconcile.service"
NEEDED = (
    "/usr/bin/make",
    "/usr/bin/weston",
    "/lib/systemd/systemd",
    "/usr/bin/dbus-daemon",
    "/usr/sbin/libvirtd",
    "/usr/sbin/virtlogd",
    "/usr/bin/virsh",
)
SCREEN = tuple(
    f"desktop_scenarios:{name}"
    for name in (
        "screen_setup",
        "screen_refused",
        "screen_release",
        "screen_crash_claim",
        "screen_crash_release",
        "screen_dm_fails",
        "screen_teardown",
    )
)
UNITS_BOOT_1 = (
    "systemd_holders",
    "attach",
    "claim_stops_units",
    "attached_exclusive",
    "crash_mid_claim",
)
UNITS_BOOT_2 = ("reconciled", "resident_helper")
PLAN = (
    Boot(("desktop", *SCREEN, *UNITS_BOOT_1), desktop=True),
    Boot(UNITS_BOOT_2),
)
# The units test's own scenarios (its invariants test reads these).
UNIT_SCENARIOS = frozenset(("desktop", *UNITS_BOOT_1, *UNITS_BOOT_2))
SCREEN_SCENARIOS = frozenset(name.rpartition(":")[2] for name in SCREEN)
assert set(desktop_scenarios.SCENARIO_SECONDS) <= SCREEN_SCENARIOS


def spec(stage: Path) -> Spec:
    return Spec(
        boots=PLAN,
        module="unit_scenarios.py",
        installed=stage,
        files=unit_scenarios.files(),
        # enabled, as the Debian package's postinst enables it
        links={
            f"/etc/systemd/system/multi-user.target.wants/{RECONCILE}": (
                f"/usr/lib/systemd/system/{RECONCILE}"
            )
        },
        keep=("/var/lib/charly-arbiter",),
        # libvirt's units are there, not started at boot: screen_setup starts them
        libvirt=True,
    )
