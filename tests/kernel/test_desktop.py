"""The GPU that drives the screen, passed through by a real libvirtd and given back,
under real systemd, logind and a real compositor (issue 19's Proof).

In the systemd guest (sysguest.py; the run test_systemd_units.py shares,
sysplan.py): weston's DRM backend as display-manager.service in a real logind
session on seat0, holding bochs-drm's card0, fbcon on bochs-drm's framebuffer; a
real libvirtd started by systemd, the package installed as `make install` lays it
out (its hook in qemu.d), and the nested TCG domain chain-a with the pair
00:02.0 + 00:02.1 as managed hostdevs.  desktop_scenarios.py runs there:

- the default policy refuses `virsh start`, naming the unit and the session;
- `screen = "release"`: the session and the display manager stop, the console is
  released, the nested QEMU gets both functions on vfio-pci, logind lists the
  arbiter's sleep lock; `virsh destroy` brings the pair home, fbcon back, the
  display manager active and weston holding card0 again, no lock;
- the arbiter killed (SIGKILL) at every step of the claim and the release after
  something was stopped, then `charly-arbiter restore`: the same end state;
- a display manager that fails at start ends on a text login, not restart-looping,
  with the failure in `charly-arbiter history`;
- I1-I3 after every step.

The timings (boot to graphical.target, each scenario, each step that waits on the
desktop) are printed with the results.
"""

from __future__ import annotations

import json
from typing import Any

import desktop_scenarios as ds
import pytest
from sysguest import Run
from sysplan import SCREEN_SCENARIOS

pytestmark = [pytest.mark.slow, pytest.mark.kernel]

GPU, AUDIO = "0000:00:02.0", "0000:00:02.1"
HOME = {GPU: "bochs-drm", AUDIO: "snd_hda_intel"}
VFIO = {GPU: "vfio-pci", AUDIO: "vfio-pci"}
GROUP_NODE = "/dev/vfio/2"  # the pair's IOMMU group in this guest
VM_CLAIMANT = f"libvirt:{ds.VM}"


@pytest.fixture(scope="module")
def guest(systemd_guest: Run) -> Run:
    print(timings(systemd_guest))
    return systemd_guest


def timings(guest: Run) -> str:
    """Boot to graphical.target, and each screen scenario's times."""
    lines = [guest.timings()]
    for record in guest.boots:
        for name in sorted(SCREEN_SCENARIOS & set(record["scenarios"])):
            scenario = record["scenarios"][name]
            points = {
                point: found.get("seconds") for point, found in scenario.get("points", {}).items()
            }
            lines.append(
                f"{name}: {record['seconds'].get(name)} s; "
                f"steps {json.dumps(scenario.get('seconds', {}))}; "
                f"waits {json.dumps(scenario.get('waits', {}))}"
                + (f"; per kill point {json.dumps(points)}" if points else "")
            )
    return "\n".join(lines)


def steps(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = record["steps"]
    return found


def ok(result: dict[str, Any]) -> None:
    assert result["rc"] == 0, f"{result['argv']} exited {result['rc']}: {result['stderr']}"


def dm(facts: dict[str, Any]) -> dict[str, str]:
    found: dict[str, str] = facts["units"][ds.DM]
    return found


def wayland(facts: dict[str, Any]) -> list[dict[str, str]]:
    return [x for x in facts["desktop"]["sessions"] if x.get("Type") == "wayland"]


def card_comms(facts: dict[str, Any]) -> set[str]:
    return {holder["comm"] for holder in facts["desktop"]["card0"]}


def locks(facts: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in facts["desktop"]["inhibitors"] if i.get("who") == "charly-arbiter"]


def assert_desktop_back(facts: dict[str, Any], context: str) -> None:
    """The end state of a release: the pair home, fbcon on bochs-drm's framebuffer
    again, the display manager active with weston holding card0 in an active wayland
    session on seat0, no lease, no sleep lock, no detached release at work."""
    assert facts["drivers"] == HOME, (context, facts["drivers"])
    assert facts["desktop"]["fbcon_bound"] is True, (context, facts["desktop"]["vtconsoles"])
    assert dm(facts)["ActiveState"] == "active", (context, dm(facts))
    assert "weston" in card_comms(facts), (context, facts["desktop"]["card0"])
    [session] = wayland(facts)
    assert (session["Active"], session["Seat"]) == ("yes", "seat0"), (context, session)
    assert facts["ledger"] == {"leases": [], "poisoned": {}}, (context, facts["ledger"])
    assert locks(facts) == [], (context, facts["desktop"]["inhibitors"])
    assert facts["finishing"] == [], context


# -- the desktop and libvirtd --------------------------------------------------------------


def test_the_desktop_and_a_real_libvirtd_come_up(guest: Run) -> None:
    setup = guest.scenario("screen_setup")
    ok(setup["dm_start"])
    ok(setup["libvirtd"])
    assert setup["waits"]["desktop_up"] is not None, steps(setup)["up"]["desktop"]
    up = steps(setup)["up"]
    assert dm(up)["ActiveState"] == "active"
    assert up["units"]["libvirtd.service"]["ActiveState"] == "active"
    assert setup["defined"] == ["chain-a", "chain-b", "chain-n"]
    assert "weston" in card_comms(up) and up["desktop"]["fbcon_bound"] is True
    assert guest.boot(1)["system"]["reached"]["graphical.target"] is not None


def test_the_arbiter_sees_the_display_manager_and_the_session_on_the_card(guest: Run) -> None:
    """Host.screen on real logind: weston's session found by its process on card0, the
    display manager by the session leader's invocation id (its unit's cgroup is empty:
    logind moved weston into session-N.scope), fbcon on the framebuffer."""
    setup = guest.scenario("screen_setup")
    screen = setup["screen"]
    up = steps(setup)["up"]
    [session] = wayland(up)
    assert screen["display_manager"] == ds.WESTON, screen
    assert screen["fbcon"] is True and screen["boot_vga"] is False, screen
    [seen] = screen["sessions"]
    assert (seen["id"], seen["seat"], seen["type"]) == (session["Id"], "seat0", "wayland"), seen
    assert str(seen["leader"]) == session["Leader"], (seen, session)
    assert "weston" in {process["comm"] for process in screen["processes"]}, screen
    assert screen["describe"].startswith(f"gpu drives seat0: {ds.WESTON}, the wayland session")
    assert f"(session {session['Id']})" in screen["describe"], screen["describe"]


def test_detect_and_explain_say_who_uses_the_screen(guest: Run) -> None:
    """Item 2 of the issue: `detect` and `explain TOKEN` say it in words."""
    setup = guest.scenario("screen_setup")
    [session] = wayland(steps(setup)["up"])
    for command in ("detect", "explain"):
        ok(setup[command])
        said = setup[command]["stdout"]
        assert ds.WESTON in said and f"session {session['Id']}" in said, (command, said)


# -- (a) refused by default ---------------------------------------------------------------------


def test_by_default_the_start_is_refused_naming_the_unit_and_the_session(guest: Run) -> None:
    record = guest.scenario("screen_refused")
    start = record["start"]
    assert start["rc"] != 0, start
    [session] = record["sessions_before"]
    assert ds.WESTON in start["stderr"], start["stderr"]
    assert f"session {session}" in start["stderr"], start["stderr"]
    refused = steps(record)["refused"]
    assert refused["drivers"] == HOME
    assert refused["domain"]["state"] == "shut off"
    assert refused["ledger"]["leases"] == []
    # nothing on the desktop moved: the same display manager, session and compositor
    assert dm(refused)["ActiveState"] == "active"
    assert dm(refused)["MainPID"] == record["dm_pid_before"]
    assert [x["Id"] for x in wayland(refused)] == [session]
    assert "weston" in card_comms(refused) and refused["desktop"]["fbcon_bound"] is True


# -- (b) released, (c) given back --------------------------------------------------------------


def test_release_stops_the_session_and_the_display_manager_and_passes_the_pair(
    guest: Run,
) -> None:
    record = guest.scenario("screen_release")
    ok(record["start"])
    running = steps(record)["running"]
    assert running["domain"]["state"] == "running"
    assert running["drivers"] == VFIO
    assert GROUP_NODE in running["domain"]["qemu_vfio"], running["domain"]
    # the display manager and its session are gone, nothing holds the card
    assert dm(running)["ActiveState"] in ("inactive", "failed"), dm(running)
    assert wayland(running) == [], running["desktop"]["sessions"]
    assert not set(record["sessions_before"]) & {x["Id"] for x in running["desktop"]["sessions"]}
    # the console released: no framebuffer console draws on the pair
    assert running["desktop"]["fbcon_bound"] is not True, running["desktop"]["vtconsoles"]
    # the lease records the display manager (and the session) it stopped
    [lease] = running["leases"]
    assert lease["claimant"] == VM_CLAIMANT and lease["state"] == "active"
    assert ds.DM_REF in {r["holder"] for r in lease["stopped"]}, lease


def test_a_sleep_lock_is_held_while_the_pair_is_passed_through(guest: Run) -> None:
    record = guest.scenario("screen_release")
    running = steps(record)["running"]
    [lock] = locks(running)
    assert "sleep" in lock["what"].split(":"), lock
    assert lock["mode"] == "block"
    assert VM_CLAIMANT in lock["why"] or ds.VM in lock["why"], lock
    assert "charly-arbiter" in running["inhibit_list"]


def test_destroy_gives_the_desktop_back(guest: Run) -> None:
    record = guest.scenario("screen_release")
    ok(record["destroy"])
    assert record["waits"]["desktop_back"] is not None
    back = steps(record)["back"]
    assert_desktop_back(back, "after destroy")
    assert "charly-arbiter" not in back["inhibit_list"]
    # a login screen again, not the session that was stopped: it cannot be resurrected
    [session] = wayland(back)
    assert session["Id"] not in record["sessions_before"]
    assert back["domain"]["state"] == "shut off"


# -- (d) killed at every step, then restore -------------------------------------------------------


@pytest.mark.parametrize("scenario", ["screen_crash_claim", "screen_crash_release"])
def test_a_kill_at_every_step_then_restore_gives_the_same_end_state(
    guest: Run, scenario: str
) -> None:
    record = guest.scenario(scenario)
    points = record["points_order"]
    if scenario == "screen_crash_claim":
        # at least the stop after the first (the display manager after the session)
        assert any(point.startswith("acquire.stop#") for point in points), points
    assert list(record["points"]) == points
    for point in points:
        found = record["points"][point]
        killed_by = found["release"] if "release" in found else found["acquire"]
        assert killed_by["rc"] == -9, (point, killed_by)
        if "release" in found:
            ok(found["acquire"])
        killed = steps(record)[f"killed at {point}"]
        assert killed["ledger"]["leases"], (point, "the killed arbiter's lease is kept")
        ok(found["restore"])
        assert found["back"], point
        assert_desktop_back(steps(record)[f"restored after {point}"], point)


# -- (e) a display manager that fails to come back -------------------------------------------


def test_a_display_manager_that_fails_ends_on_a_text_login(guest: Run) -> None:
    record = guest.scenario("screen_dm_fails")
    ok(record["start"])
    ok(record["destroy"])
    before = steps(record)["before"]
    assert before["units"][ds.GETTY]["ActiveState"] == "inactive"
    assert record["gettys_before"] == []
    assert record["waits"]["text_login"] is not None
    login = steps(record)["text_login"]
    assert login["drivers"] == HOME
    # a text login on the console in front (the arbiter's getty), fbcon drawing it
    [getty] = login["gettys"]
    assert getty == f"getty@{login['desktop']['active_vt']}.service", login["desktop"]
    assert login["desktop"]["fbcon_bound"] is True
    # not left restart-looping (the drop-in says Restart=always, RestartSec=1)
    first, then = login["dm_first"], dm(login)
    assert then["ActiveState"] in ("inactive", "failed"), then
    assert then["NRestarts"] == first["NRestarts"], (first, then)
    assert any("control process exited" in line.lower() for line in login["dm_journal"])
    assert "weston" not in card_comms(login)
    assert locks(login) == []


def test_the_failure_is_in_the_history_and_explain_says_what_to_do(guest: Run) -> None:
    record = guest.scenario("screen_dm_fails")
    ok(record["history"])
    history = record["history"]["stdout"]
    failed = [line for line in history.splitlines() if "restore-failed" in line]
    assert failed and ds.WESTON in failed[-1], history
    tty = steps(record)["text_login"]["desktop"]["active_vt"]
    assert f"text login runs on {tty}" in failed[-1], failed
    [event] = [e for e in json.loads(record["history_json"]["stdout"]) if e.get("journal")]
    assert "Control process exited" in event["journal"], event
    # the lease is kept, stranded, and says why and what to do
    [lease] = steps(record)["text_login"]["leases"]
    assert lease["claimant"] == VM_CLAIMANT and lease["state"] == "releasing", lease
    assert {"holder": ds.DM_REF, "state": "done", "restored": False} in lease["stopped"]
    ok(record["explain_claimant"])
    story = record["explain_claimant"]["stdout"]
    assert "did not come back" in story and "Fix:" in story, story
    assert f"charly-arbiter restore {VM_CLAIMANT}" in story, story


def test_explain_of_the_token_tells_of_the_display_manager_not_back(guest: Run) -> None:
    """`explain gpu` while the lease is kept (the GPU home, its display manager not):
    the token's story says so and what to do, as the claimant's does."""
    record = guest.scenario("screen_dm_fails")
    ok(record["explain"])
    story = record["explain"]["stdout"]
    assert "did not come back" in story, story
    assert f"charly-arbiter restore {VM_CLAIMANT}" in story, story


def test_mending_the_display_manager_and_restore_give_the_desktop_back(guest: Run) -> None:
    record = guest.scenario("screen_dm_fails")
    ok(record["restore"])
    assert_desktop_back(steps(record)["mended"], "after the mend and restore")


# -- I1-I3, and the state left to the units test ---------------------------------------------


def test_every_step_keeps_the_invariants(guest: Run) -> None:
    """I1-I3 after every step of every screen scenario, the display manager a holder
    that runs unless a lease records it stopped."""
    checked = 0
    for name in sorted(SCREEN_SCENARIOS):
        for label, facts in guest.scenario(name).get("steps", {}).items():
            assert facts["violations"] == [], f"{name}/{label}: {facts['violations']}"
            checked += 1
    assert checked >= 20


def test_the_screen_scenarios_leave_the_guest_as_they_found_it(guest: Run) -> None:
    clean = steps(guest.scenario("screen_teardown"))["clean"]
    assert clean["ledger"] == {"leases": [], "poisoned": {}}
    assert clean["drivers"] == HOME
    assert clean["card0"] == []
    assert clean["units"]["libvirtd.service"]["ActiveState"] == "inactive"
    assert clean["units"][ds.GETTY]["ActiveState"] == "active"
