"""systemd units as holders and claimants, under a real systemd (sysguest.py).

One QEMU run (sysplan.py: test_desktop.py's scenarios run in the same boots),
two boots of the real-kernel guest with systemd as PID 1 on an overlay of this
machine's root, the package installed by `make install` and the units of
unit_scenarios.py (real services: `sleep` holding bochs-drm's /dev/dri/card0, a
drained one, a per-GPU template standing in for NVIDIA's per-GPU persistence,
units made to claim by `charly-arbiter attach`).

Boot 1 (graphical.target): weston as display-manager.service holds card0 in
a real logind session on seat0 (the desktop the screen scenarios of issue 19
build on); host/holders/systemd.py against the real systemctl; `attach`'s
drop-ins run by systemd itself (ExecStartPre claims, ExecStopPost releases:
on `systemctl stop`, on a refused start, on a crash of the main process); an
exclusive claim that stops, drains and preempts units and starts them again;
then a claim killed with SIGKILL after it stopped a unit, and a power cut.
Boot 2 (multi-user.target), with the state directory kept on the share as a
disk keeps it: the package's reconcile unit, enabled as the Debian package
enables it, ran `restore --stranded` at boot and put the host back.

The invariants I1-I3 (tests/invariants.py) are checked by the guest after
every step of every scenario; these tests judge what it recorded.
"""

from __future__ import annotations

from typing import Any

import pytest
import unit_scenarios as us
from sysguest import Run
from sysplan import UNIT_SCENARIOS

pytestmark = [pytest.mark.slow, pytest.mark.kernel]

GPU, AUDIO = "0000:00:02.0", "0000:00:02.1"
HOME = {GPU: "bochs-drm", AUDIO: "snd_hda_intel"}
VFIO = {GPU: "vfio-pci", AUDIO: "vfio-pci"}


@pytest.fixture(scope="module")
def guest(systemd_guest: Run) -> Run:
    """The systemd guest's run (sysplan.py), shared with test_desktop.py."""
    return systemd_guest


def steps(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = record["steps"]
    return found


def lease_claims(facts: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(x["claimant"], x["mode"], x["state"]) for x in facts["ledger"]["leases"]]


def holders_of_card(facts: dict[str, Any]) -> set[str]:
    return {holder["unit"] for holder in facts["card0"]}


def state(facts: dict[str, Any], unit: str) -> str:
    return str(facts["units"][unit]["ActiveState"])


def ok(result: dict[str, Any]) -> None:
    assert result["rc"] == 0, f"{result['argv']} exited {result['rc']}: {result['stderr']}"


# -- the guest ---------------------------------------------------------------------------------


def test_systemd_boots_the_guest_to_its_targets(guest: Run) -> None:
    for number, target in ((1, "graphical.target"), (2, "multi-user.target")):
        system = guest.boot(number)["system"]
        assert system["state"] == "running", system
        assert system["failed"] == [], system
        assert system["reached"][target] is not None, system
        assert system["reached"]["systemd"] < system["reached"]["multi-user.target"], system
    assert guest.boot(1)["system"]["boot_id"] != guest.boot(2)["system"]["boot_id"]


def test_every_step_keeps_the_invariants(guest: Run) -> None:
    """I1-I3 after every step of every scenario of this file, both boots
    (test_desktop.py checks its own)."""
    checked = 0
    for record in guest.boots:
        for name, scenario in record["scenarios"].items():
            if name not in UNIT_SCENARIOS:
                continue
            for label, facts in scenario.get("steps", {}).items():
                assert facts["violations"] == [], f"{name}/{label}: {facts['violations']}"
                checked += 1
    assert checked >= 12


# -- the desktop (what issue 19's screen scenarios start from) -----------------------------------


def test_weston_holds_card0_in_a_logind_session_on_seat0(guest: Run) -> None:
    desktop = guest.scenario("desktop")
    up = desktop["up"]
    assert up["display_manager"]["Id"] == "charly-weston.service"
    assert up["display_manager"]["ActiveState"] == "active"
    [session] = up["sessions"]
    assert {k: session[k] for k in ("Type", "Class", "Seat", "TTY", "Active", "Service")} == {
        "Type": "wayland",
        "Class": "user",
        "Seat": "seat0",
        "TTY": "tty7",
        "Active": "yes",
        "Service": "login",
    }
    assert session["Leader"] == up["display_manager"]["MainPID"]
    assert up["seat0"]["ActiveSession"] == session["Id"]
    assert up["seat0"]["CanGraphical"] == "yes"
    by_comm = {holder["comm"]: holder["unit"] for holder in up["card0"]}
    assert by_comm["weston"] == f"session-{session['Id']}.scope"
    # logind opened the card for the session (and keeps it in PID 1's fd store)
    assert by_comm["systemd-logind"] == "systemd-logind.service"
    assert "weston" in desktop["fuser"]["stderr"]
    assert up["fbcon_bound"] is True and up["active_vt"] == "tty7"


def test_the_local_host_reads_who_uses_the_screen_on_real_systemd(guest: Run) -> None:
    """host/screen.py on the real thing: weston, in session-N.scope (its unit's own
    cgroup empty), is charly-weston.service's by the leader's INVOCATION_ID; the
    session is wayland on seat0 of charly-weston; bochs-drm is the boot display with
    fbcon on it.  Once the display manager is stopped, only those remain."""
    desktop = guest.scenario("desktop")
    up = desktop["screen_up"]
    assert up["display_manager"] == "charly-weston.service", up
    [session] = up["sessions"]
    assert (session["seat"], session["type"], session["user"]) == (
        "seat0",
        "wayland",
        "charly-weston",
    ), up
    assert session["display_manager"] == "charly-weston.service", up
    westons = [p for p in up["processes"] if p["comm"] == "weston"]
    assert westons and all("card0" in p["nodes"] for p in westons), up
    assert all(p["unit"].startswith("session-") for p in westons), up
    assert up["text"].startswith("gpu drives seat0: charly-weston.service, the wayland session")
    down = desktop["screen_down"]
    assert (down["processes"], down["sessions"], down["display_manager"]) == ([], [], None), down
    assert (up["boot_vga"], up["fbcon"]) == (down["boot_vga"], down["fbcon"]), (up, down)
    print(f"screen read in {up['seconds']} s: {up['text']}")


def test_an_inhibitor_lock_is_listed(guest: Run) -> None:
    desktop = guest.scenario("desktop")
    assert {
        "what": "sleep",
        "who": "charly-test",
        "why": "a test lock",
        "mode": "block",
    }.items() <= (next(i for i in desktop["inhibitors"] if i["who"] == "charly-test").items())
    assert "1 inhibitors listed." in desktop["inhibit_list"]["stdout"]


def test_stopping_the_display_manager_frees_card0_and_ends_the_session(guest: Run) -> None:
    desktop = guest.scenario("desktop")
    ok(desktop["stop"])
    down = desktop["down"]
    assert desktop["card_free_after"] is not None, down["card0"]
    assert down["card0"] == [] and down["sessions"] == []
    assert down["display_manager"]["ActiveState"] == "inactive"
    assert down["fbcon_bound"] is True


# -- units as holders ------------------------------------------------------------------------------


def test_the_systemd_source_drives_the_real_systemctl(guest: Run) -> None:
    """Where a script stood in for systemctl (test_unit_and_container_holders.py in
    tests/libvirt): a unit named like an option is started, seen and stopped (only `--`
    keeps it a name), listed for its own token only, and a start that fails or a stop of
    a unit that does not exist is a HolderError naming the unit."""
    holders = guest.scenario("systemd_holders")
    assert holders["systemctl"] == "/usr/bin/systemctl"
    assert holders["not_running"] is False
    assert holders["started"] == {"source": True, "systemd": True}
    assert holders["holder"] == {
        "ref": f"systemd:{us.DASHED}",
        "running": True,
        "how": "systemctl stop",
    }
    assert holders["other_token"] == []
    assert holders["stopped"] == {"source": False, "systemd": False}
    assert holders["failed_start"].startswith(
        "could not start systemd:charly-start-fails.service: /usr/bin/systemctl exited with 1"
    )
    assert holders["failed_stop"].startswith("could not stop systemd:charly-gone.service: ")
    assert "charly-gone.service not loaded" in holders["failed_stop"]
    assert holders["failed_unit"]["Result"] == "exit-code"


def test_an_exclusive_claim_stops_the_unit_holding_card0_and_starts_it_again(guest: Run) -> None:
    record = guest.scenario("claim_stops_units")
    ok(record["acquire"])
    ok(record["release"])
    running, claimed, released = (steps(record)[k] for k in ("running", "claimed", "released"))
    # the unit's process holds the card, and counts as the unit's (not a stray process)
    assert us.HOLDER in holders_of_card(running)
    assert (
        "stopping systemd:charly-card-holder.service (systemctl stop)"
        in record["acquire"]["stderr"]
    )
    assert state(claimed, us.HOLDER) == "inactive"
    assert claimed["drivers"] == VFIO and claimed["card0"] == []
    assert lease_claims(claimed) == [(record["claimant"], "exclusive", "active")]
    assert released["drivers"] == HOME
    assert state(released, us.HOLDER) == "active"
    assert us.HOLDER in holders_of_card(released)
    assert released["pids"][us.HOLDER] != running["pids"][us.HOLDER]


def test_an_exclusive_claim_holds_logind_s_sleep_lock_until_its_release(guest: Run) -> None:
    """host/inhibit.py under the real systemd and logind: the transient unit runs
    systemd-inhibit, logind lists the lock (what sleep, who charly-arbiter, mode block,
    the why naming the claimant), and the release stops the unit and ends the lock."""
    record = guest.scenario("claim_stops_units")
    claimed, released = (steps(record)[k] for k in ("claimed", "released"))
    why = f"gpu is passed through to {record['claimant']}"
    ours = [i for i in claimed["inhibitors"] if i["who"] == "charly-arbiter"]
    assert len(ours) == 1, claimed["inhibitors"]
    assert {"what": "sleep", "who": "charly-arbiter", "why": why, "mode": "block"}.items() <= (
        ours[0].items()
    )
    assert claimed["lock_unit"]["ActiveState"] == "active"
    assert claimed["lock_unit"]["Description"] == why
    assert why in claimed["inhibit_list"]["stdout"]
    assert [lease["sleep_locks"] for lease in claimed["ledger"]["leases"]] == [["gpu"]]
    assert [i for i in released["inhibitors"] if i["who"] == "charly-arbiter"] == []
    assert released["lock_unit"]["LoadState"] == "not-found"


def test_only_the_claimed_gpus_instance_of_a_per_gpu_service_stops(guest: Run) -> None:
    """The per-GPU template stands in for NVIDIA's per-GPU persistence (nvidia-persistenced
    and nvidia-smi cannot run here): the claimed GPU's instance is stopped and started
    again, another GPU's instance keeps running, the same process all along."""
    record = guest.scenario("claim_stops_units")
    mine, other = us.PERSISTENCE.format(GPU), us.PERSISTENCE.format(us.OTHER_GPU)
    running, claimed, released = (steps(record)[k] for k in ("running", "claimed", "released"))
    assert mine in holders_of_card(running)
    assert state(claimed, mine) == "inactive"
    assert state(released, mine) == "active" and mine in holders_of_card(released)
    assert state(claimed, other) == state(released, other) == "active"
    assert running["pids"][other] == claimed["pids"][other] == released["pids"][other] != "0"


def test_a_unit_drained_in_place_lets_go_of_card0_and_takes_it_again(guest: Run) -> None:
    record = guest.scenario("claim_stops_units")
    running, claimed, released = (steps(record)[k] for k in ("running", "claimed", "released"))
    assert us.DRAINED in holders_of_card(running)
    # running through the claim, the same main process, not holding the card
    assert state(claimed, us.DRAINED) == "active"
    assert us.DRAINED not in holders_of_card(claimed)
    assert (
        running["pids"][us.DRAINED] == claimed["pids"][us.DRAINED] == released["pids"][us.DRAINED]
    )
    assert us.DRAINED in holders_of_card(released)
    signals = [line for line in record["journals"][us.DRAINED] if "Sent signal" in line]
    assert [line.split()[3] for line in signals] == ["SIGUSR1", "SIGUSR2"], signals


def test_a_shared_attached_unit_is_preempted_and_claims_again(guest: Run) -> None:
    """Its ExecStopPost releases its shared lease while the exclusive claim is under way
    (nested in the claim's `systemctl stop`); at release it is started again, and its
    ExecStartPre claims again."""
    record = guest.scenario("claim_stops_units")
    running, claimed, released = (steps(record)[k] for k in ("running", "claimed", "released"))
    infer = f"systemd:{us.INFER}"
    assert (infer, "shared", "active") in lease_claims(running)
    assert state(claimed, us.INFER) == "inactive"
    assert [c for c in lease_claims(claimed) if c[0] == infer] == []
    assert lease_claims(claimed) == [(record["claimant"], "exclusive", "active")]
    assert state(released, us.INFER) == "active"
    assert lease_claims(released) == [(infer, "shared", "active")]
    journal = record["journals"][us.INFER]
    assert sum(f"{infer} claims gpu (shared)" in line for line in journal) == 2, journal
    assert any(f"{infer} holds no lease" in line or f"released {infer}" in line for line in journal)
    stopped = steps(record)["stopped"]
    assert stopped["ledger"]["leases"] == [] and stopped["drivers"] == HOME


# -- `attach`: systemd runs the drop-in -----------------------------------------------------------


def test_attach_writes_drop_ins_that_systemd_loads(guest: Run) -> None:
    record = guest.scenario("attach")
    ok(record["shared"])
    ok(record["exclusive"])
    for unit, mode in ((us.INFER, "shared"), (us.VMLIKE, "exclusive")):
        dropin = f"/etc/systemd/system/{unit}.d/charly-arbiter.conf"
        assert record[unit]["dropins"] == {"DropInPaths": dropin, "NeedDaemonReload": "no"}
        cat = record[unit]["cat"]
        assert (
            f"ExecStartPre=+/usr/bin/charly-arbiter acquire --{mode} -- systemd:{unit} gpu" in cat
        )
        assert f"ExecStopPost=-+/usr/bin/charly-arbiter release --force -- systemd:{unit}" in cat


def test_an_exclusive_attached_unit_runs_on_vfio_and_comes_home_at_stop(guest: Run) -> None:
    record = guest.scenario("attached_exclusive")
    vm = f"systemd:{us.VMLIKE}"
    started, stopped, again = (steps(record)[k] for k in ("started", "stopped", "started_again"))
    for facts in (started, again):
        assert state(facts, us.VMLIKE) == "active"
        assert facts["drivers"] == VFIO and "2" in facts["vfio"]
        assert lease_claims(facts) == [(vm, "exclusive", "active")]
    assert state(stopped, us.VMLIKE) == "inactive"
    assert stopped["drivers"] == HOME and stopped["ledger"]["leases"] == []


def test_a_refused_start_fails_the_unit_with_the_arbiters_reason(guest: Run) -> None:
    record = guest.scenario("attached_exclusive")
    refused = steps(record)["refused"]
    assert record["refused"]["rc"] != 0
    assert refused["units"][us.INFER]["ActiveState"] == "failed"
    assert refused["units"][us.INFER]["Result"] == "exit-code"
    assert any(
        f"gpu is held exclusively by systemd:{us.VMLIKE}" in line for line in refused["journal"]
    ), refused["journal"]
    # the exclusive unit keeps its lease and the pair
    assert lease_claims(refused) == [(f"systemd:{us.VMLIKE}", "exclusive", "active")]
    assert refused["drivers"] == VFIO


def test_a_crashed_attached_unit_releases_through_its_exec_stop_post(guest: Run) -> None:
    record = guest.scenario("attached_exclusive")
    ok(record["kill"])
    crashed = steps(record)["crashed"]
    assert crashed["units"][us.VMLIKE]["ActiveState"] == "failed"
    assert crashed["units"][us.VMLIKE]["Result"] == "signal"
    assert crashed["drivers"] == HOME and crashed["ledger"]["leases"] == []
    journal = crashed["journal"]
    killed = next(i for i, line in enumerate(journal) if "code=killed, status=9/KILL" in line)
    released = next(i for i, line in enumerate(journal) if f"released systemd:{us.VMLIKE}" in line)
    assert killed < released, journal


# -- a crash mid-claim, and the reconcile unit at the next boot --------------------------------


def test_a_claim_killed_after_stopping_a_unit_leaves_it_recorded(guest: Run) -> None:
    record = guest.scenario("crash_mid_claim")
    assert record["acquire"]["rc"] == -9, record["acquire"]
    killed = steps(record)["killed"]
    assert lease_claims(killed) == [(record["claimant"], "exclusive", "acquiring")]
    assert state(killed, us.HOLDER) == "inactive"
    assert killed["drivers"] == HOME  # killed before the switch
    # no ledger yet when this boot began, but a configuration: the reconcile unit ran
    # (it sets the configured VF counts too), finding nothing to restore
    assert record["reconcile_this_boot"]["ConditionResult"] == "yes"
    assert record["reconcile_this_boot"]["UnitFileState"] == "enabled"
    assert "crashed_at" in record


def test_the_reconcile_unit_puts_the_host_back_at_the_next_boot(guest: Run) -> None:
    claimant = guest.scenario("crash_mid_claim")["claimant"]
    record = guest.scenario("reconciled")
    reconcile = record["reconcile"]
    assert reconcile["ConditionResult"] == "yes"
    assert (reconcile["Result"], reconcile["ExecMainStatus"]) == ("success", "0"), record[
        "reconcile_journal"
    ]
    journal = record["reconcile_journal"]
    assert any(f"restoring {claimant}" in line for line in journal), journal
    assert any(f"{claimant}: systemd:{us.HOLDER} runs again" in line for line in journal), journal
    # the holder is not enabled: only the reconcile unit started it, while it ran
    holder = record["holder"]
    assert holder["ActiveState"] == "active" and holder["UnitFileState"] == "static"
    begun, ended = (
        int(reconcile["ExecMainStartTimestampMonotonic"]),
        int(reconcile["ExecMainExitTimestampMonotonic"]),
    )
    assert begun < int(holder["ExecMainStartTimestampMonotonic"]) < ended
    after = steps(record)["after_boot"]
    assert after["ledger"] == {"leases": [], "poisoned": {}}
    assert after["drivers"] == HOME
    assert us.HOLDER in holders_of_card(after)
    assert after["violations"] == []


# -- the resident helper ---------------------------------------------------------------------


def test_the_resident_helper_is_socket_activated_and_never_in_the_way(guest: Run) -> None:
    """charly-arbiter.socket and .service, as installed, under systemd as PID 1."""
    record = guest.scenario("resident_helper")
    ok(record["start"])
    assert record["socket"] == {"socket": True, "mode": "0o600", "uid": 0}
    ok(record["status"])  # CHARLY_ARBITER_SERVE=must: the service took it
    assert record["service"]["ActiveState"] == "active", record["journal"]
    assert record["service"]["KillMode"] == "process"
    ok(record["acquire"])
    # The release's child was in the service's cgroup when the service stopped, and
    # stayed (KillMode=process): the command finished, through the helper.
    before, after = set(record["in_service_before_stop"]), set(record["in_service_after_stop"])
    assert after and after <= before, (before, after)
    assert int(record["service"]["MainPID"]) not in after
    ok(record["stop_service"])
    assert record["release"]["rc"] == 0, record["release"]
    assert steps(record)["released"]["ledger"]["leases"] == []
    ok(record["stop_all"])
    assert record["socket_after_stop"] is False, "RemoveOnStop= took the socket away"
    ok(record["in_process"])
