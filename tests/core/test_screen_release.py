"""`screen = "release"`: a claim on the GPU that draws the desktop stops, in order and
each recorded in the lease first, the user units holding it, the sessions on it (told
why first) and the display manager; the release gives the display manager back once
the GPU is home, and one that fails ends on a text login, with what to do.

The pure rule (`planner.screen_stops`) over values; the rest on the simulated host,
whose `[[screens]]` model a display manager, its sessions and a user unit (and a
display manager that fails to come up); crashes are real kill -9s of the CLI."""

from __future__ import annotations

import json
import re
import signal

import pytest
from simhosts import audio, desktop, gpu, holder, host

from charly_arbiter.compose import build_arbiter
from charly_arbiter.core.config import load_config
from charly_arbiter.core.host import (
    Holder,
    PciFunction,
    ScreenProcess,
    ScreenSession,
    ScreenUse,
    TokenSpec,
)
from charly_arbiter.core.model import (
    Claimant,
    LeaseState,
    LedgerState,
    Mode,
    ScreenPolicy,
    StepState,
)
from charly_arbiter.core.planner import decide_claim, screen_stops
from tests.conftest import SIM_CONFIG

GPU0, AUDIO0, GPU1 = "0000:0a:00.0", "0000:0a:00.1", "0000:0b:00.0"
DM = "display-manager:gdm.service"
SESSION = "session:3"
SHELL = "systemd-user:1000/org.gnome.Shell@wayland.service"
SCREEN = (SHELL, SESSION, DM)  # the order they are stopped in


# -- the rule, over values --------------------------------------------------------------------


def spec(screen: ScreenPolicy = ScreenPolicy.RELEASE, name: str = "gpu0") -> TokenSpec:
    functions = (
        PciFunction(GPU0, "10de", "2684", "030000", "nvidia", "12"),
        PciFunction(AUDIO0, "10de", "22ba", "040300", "snd_hda_intel", "12"),
    )
    return TokenSpec(name, GPU0, functions, screen=screen)


def desktop_use(token: str = "gpu0") -> ScreenUse:
    session = ScreenSession("3", "seat0", "wayland", 1000, "alice", 900, "gdm.service")
    return ScreenUse(
        token,
        boot_vga=True,
        fbcon=True,
        processes=(
            ScreenProcess(
                912,
                "gnome-shell",
                1000,
                ("card0",),
                None,
                "user@1000.service/session.slice/org.gnome.Shell@wayland.service",
            ),
            ScreenProcess(905, "Xwayland", 1000, ("card0",), "3", "session-3.scope"),
            ScreenProcess(700, "gdm-greeter", 0, ("card0",), None, "gdm.service"),
        ),
        sessions=(session,),
        display_manager="gdm.service",
        user_units=("user@1000.service: org.gnome.Shell@wayland.service",),
    )


def process_holder(pid: int) -> Holder:
    return Holder(Claimant.of("process", str(pid)), ("gpu0",), preemptible=False, running=True)


def test_the_user_units_then_the_sessions_then_the_display_manager() -> None:
    """Each once, in that order, with the token; the screen's processes and a display
    manager listed as a systemd holder go with them (a process of nobody's stays)."""
    listed = Holder(Claimant.parse("systemd:display-manager.service"), ("gpu0",), True, True)
    stranger = process_holder(4242)
    holders = [process_holder(912), process_holder(905), process_holder(700), stranger, listed]
    left, steps = screen_stops([spec()], {"gpu0": desktop_use()}, holders)
    assert [str(step.holder) for step in steps] == list(SCREEN)
    assert all(step.tokens == ("gpu0",) for step in steps)
    assert left == [stranger]


@pytest.mark.parametrize(
    "use",
    [
        ScreenUse("gpu0", boot_vga=True, fbcon=True),  # the console alone: the host releases it
        ScreenUse("gpu0", boot_vga=False, fbcon=False),
    ],
)
def test_a_screen_without_a_desktop_stops_nothing(use: ScreenUse) -> None:
    holders = [process_holder(4242)]
    assert screen_stops([spec()], {"gpu0": use}, holders) == (holders, [])


def test_refuse_leaves_it_to_the_refusal_and_a_shared_claim_leaves_the_screen() -> None:
    holders = [process_holder(912)]
    refused = screen_stops([spec(ScreenPolicy.REFUSE)], {"gpu0": desktop_use()}, holders)
    assert refused == (holders, [])
    # A shared claim keeps the GPU on its driver: nothing of the screen is stopped.
    plan = decide_claim(
        LedgerState(),
        Claimant.parse("container:c"),
        Mode.SHARED,
        [spec()],
        [],
        frozenset(),
        screens={"gpu0": desktop_use()},
    )
    assert plan.stops == ()


def test_an_exclusive_claim_stops_the_screen_last() -> None:
    """A VM that holds the GPU too is stopped first: the desktop stays up meanwhile."""
    vm = Holder(Claimant.parse("libvirt:other"), ("gpu0",), True, True, passthrough=True)
    plan = decide_claim(
        LedgerState(),
        Claimant.parse("libvirt:win11"),
        Mode.EXCLUSIVE,
        [spec()],
        [vm, process_holder(912)],
        frozenset(),
        screens={"gpu0": desktop_use()},
    )
    assert [str(step.holder) for step in plan.stops] == ["libvirt:other", *SCREEN]


# -- on the simulated host ------------------------------------------------------------------

HOST = host(
    gpu(GPU0, group=12),
    audio(AUDIO0, group=12),
    gpu(GPU1, group=13, model="2204"),
    holder("systemd", "ollama.service", ["gpu0"], preemptible=True),
    desktop(GPU0),
)
# The suite's simulated configuration, its desktop told for a hundredth of a second,
# gpu0's screen given up rather than refused.
CONFIG = (
    SIM_CONFIG
    + "screen_grace = 0.01\n"
    + '\n[tokens.gpu0]\naddress = "0000:0a:00.0"\nscreen = "release"\n'
    + '\n[tokens.gpu1]\naddress = "0000:0b:00.0"\n'
)
HOME = {GPU0: "nvidia", AUDIO0: "snd_hda_intel", GPU1: "nvidia"}


@pytest.fixture
def desk(make_sim):
    sim = make_sim(host=HOST, config=CONFIG)
    # The arbiter of a command: its events go to the history, as the CLI's do.
    sim.arbiter = lambda: build_arbiter(load_config(sim.config_path, environ={}))
    return sim


def log_of(sim) -> list[str]:
    return sim.host().snapshot()["log"]


def running(sim, ref: str) -> bool:
    return bool(sim.host().snapshot()["running"].get(ref))


def history(sim) -> list[dict]:
    path = sim.state_dir / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_claim_tells_the_session_then_stops_its_desktop_in_order(desk):
    arbiter = desk.arbiter()
    plan = arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert [str(step.holder) for step in plan.stops] == ["systemd:ollama.service", *SCREEN]
    lines = log_of(desk)
    told = next(i for i, line in enumerate(lines) if line.startswith(f"tell {SESSION}: "))
    stops = [lines.index(f"stop {ref}") for ref in SCREEN]
    switch = next(i for i, line in enumerate(lines) if line == f"switch {GPU0} vfio-pci")
    assert told < stops[0] < stops[1] < stops[2] < switch, lines
    assert "gpu0 is given to libvirt:win11" in lines[told]
    assert not any(running(desk, ref) for ref in SCREEN)
    lease = arbiter.ledger.read().lease_of(Claimant.parse("libvirt:win11"))
    assert lease is not None and lease.state is LeaseState.ACTIVE
    assert [(str(r.holder), r.state) for r in lease.stopped][1:] == [
        (ref, StepState.DONE) for ref in SCREEN
    ]
    assert next(e["event"] for e in history(desk) if e.get("holder") == SESSION) == "told"


def test_the_release_gives_the_display_manager_back_not_the_session(desk):
    arbiter = desk.arbiter()
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    desk.stopped("libvirt:win11")
    before = len(log_of(desk))
    assert arbiter.release_claimant("libvirt:win11")
    lines = log_of(desk)[before:]
    home = lines.index(f"switch {GPU0} nvidia")
    assert lines.index(f"start {DM}") > home  # the GPU home first
    assert f"start {SESSION}" not in lines
    assert running(desk, DM) and not running(desk, SESSION) and running(desk, SHELL)
    assert arbiter.ledger.read().leases == ()
    assert desk.host().snapshot()["drivers"] == HOME
    ended = [e for e in history(desk) if e["event"] == "session-ended"]
    assert [e["holder"] for e in ended] == [SESSION]
    # The login screen is what came back: a claim now stops the display manager alone.
    use = desk.host().screen(arbiter.tokens.reread(["gpu0"])[0])
    assert use.display_manager == "gdm.service" and use.sessions == ()
    plan = arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert [str(step.holder) for step in plan.stops][-2:] == [SHELL, DM]


def test_a_display_manager_that_fails_ends_on_a_text_login_with_what_to_do(desk):
    desk.set_host(HOST.replace('user_units = ["org', 'fail_start = true\nuser_units = ["org'))
    arbiter = desk.arbiter()
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    desk.stopped("libvirt:win11")
    assert arbiter.release_claimant("libvirt:win11")
    assert not running(desk, DM) and running(desk, "systemd:getty@tty1.service")
    assert desk.host().snapshot()["drivers"] == HOME  # the GPU came home all the same
    lease = arbiter.ledger.read().lease_of(Claimant.parse("libvirt:win11"))
    assert lease is not None and lease.state is LeaseState.RELEASING and lease.owner is None
    assert [str(r.holder) for r in lease.unrestored()] == [DM]
    failed = [e for e in history(desk) if e["event"] == "restore-failed"]
    assert failed[-1]["holder"] == DM and failed[-1]["console"] == "tty1"
    assert "simulated failure" in failed[-1]["journal"]
    assert "no restart loop" in failed[-1]["why"]
    status = desk.status()
    assert "libvirt:win11" in status["stranded"]
    words = desk.cli("explain", "libvirt:win11").stdout
    assert "the display manager gdm.service did not come back when gpu0 came home" in words
    assert "journalctl -u gdm.service" in words and "a text login runs on tty1" in words
    # The token's own story tells it too: it is home, but its desktop is not back.
    words = desk.cli("explain", "gpu0").stdout
    assert "did not come back when gpu0 came home" in words, words
    assert "charly-arbiter restore libvirt:win11" in words
    # Mended, `restore` starts it again and checks it.
    desk.set_host(HOST)
    assert desk.cli("restore", "--stranded").returncode == 0
    assert running(desk, DM) and arbiter.ledger.read().leases == ()


def test_a_display_manager_waits_for_a_gpu_that_did_not_come_home(desk):
    arbiter = desk.arbiter()
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    # Its way home fails: the switch poisons gpu0 and leaves it on vfio-pci.
    desk.set_host(HOST.replace("iommu_group = 12\n", "iommu_group = 12\nfail_switch = true\n", 1))
    desk.stopped("libvirt:win11")
    before = len(log_of(desk))
    arbiter.release_claimant("libvirt:win11")
    assert f"start {DM}" not in log_of(desk)[before:]
    lease = arbiter.ledger.read().lease_of(Claimant.parse("libvirt:win11"))
    assert lease is not None and DM in [str(r.holder) for r in lease.unrestored()]
    words = desk.cli("explain", "libvirt:win11").stdout
    assert "the display manager gdm.service waits for gpu0, which did not come home" in words, words
    # `restore` lets go of gpu0 poisoned (an operator's to look at) and starts the
    # display manager all the same, as any holder comes back beside a poisoned GPU.
    assert desk.cli("restore", "--stranded").returncode == 0
    assert running(desk, DM) and arbiter.ledger.read().leases == ()
    assert arbiter.ledger.read().poison_of("gpu0") is not None


# -- kill -9 at every step, then restore: the desktop comes back --------------------------------

ACQUIRE = ("acquire.intent", "acquire.stop#1", "acquire.stop#3", "acquire.stop#4",
           "acquire.switch", "acquire.active")  # fmt: skip
RELEASE = ("release.intent", "release.switch", "release.start#1", "release.start#2",
           "release.start#3", "release.restored")  # fmt: skip


@pytest.mark.parametrize(
    ("scenario", "step"), [("acquire", s) for s in ACQUIRE] + [("release", s) for s in RELEASE]
)
def test_kill_9_at_every_step_then_restore_gives_the_desktop_back(desk, scenario, step):
    if scenario == "release":
        desk.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
        desk.stopped("libvirt:win11")
        args = ("release", "libvirt:win11")
    else:
        args = ("acquire", "--exclusive", "libvirt:win11", "gpu0")
    result = desk.cli(*args, env=desk.env(CHARLY_ARBITER_CRASH_AT=step))
    assert result.returncode == -signal.SIGKILL, f"never reached {step}: {result.stderr}"
    desk.cli("sim", "stop", "libvirt:win11", check=True)
    restored = desk.cli("restore", "--stranded")
    assert restored.returncode == 0, restored.stderr
    assert desk.arbiter().ledger.read().leases == ()
    assert desk.host().snapshot()["drivers"] == HOME
    assert running(desk, DM), log_of(desk)
    assert running(desk, "systemd:ollama.service")
    # The session ran on unless the claim had got as far as ending it.
    stopped = f"stop {SESSION}" in log_of(desk)
    assert running(desk, SESSION) is not stopped


def test_a_display_manager_listed_for_another_gpu_stays_a_holder_of_that_gpu() -> None:
    """Found by the state machine: `systemd:display-manager.service` listed for gpu1 is
    not gpu0's display manager, whatever its name; a claim on both stops it as a holder
    of gpu1."""
    other = Holder(Claimant.parse("systemd:display-manager.service"), ("gpu1",), True, True)
    gpu1 = TokenSpec("gpu1", GPU1, (PciFunction(GPU1, "10de", "2204", "030000", "nvidia", "13"),))
    left, steps = screen_stops([spec(), gpu1], {"gpu0": desktop_use()}, [other])
    assert left == [other] and [str(step.holder) for step in steps] == list(SCREEN)


def test_a_nested_hook_stops_no_screen() -> None:
    """The arbiter starting a VM again (its hook nested in a release) never stops a
    holder, a desktop included: the claim is refused by its policy."""
    from charly_arbiter.core.model import SCREEN_KINDS
    from charly_arbiter.core.planner import Policy
    from charly_arbiter.errors import ClaimRefused

    nested = Policy(refuse_kinds=frozenset(SCREEN_KINDS), refuse_hint="stop {holder} first")
    with pytest.raises(ClaimRefused, match=re.escape(SHELL)):
        decide_claim(
            LedgerState(),
            Claimant.parse("libvirt:win11"),
            Mode.EXCLUSIVE,
            [spec()],
            [],
            frozenset(),
            policy=nested,
            screens={"gpu0": desktop_use()},
        )


def test_plan_release_says_what_comes_back_and_what_does_not(desk):
    desk.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    desk.stopped("libvirt:win11")
    words = desk.cli("plan", "--release", "libvirt:win11", check=True).stdout
    assert (
        f"start {DM} again, and check that it draws on its GPU (else a text login on the "
        "console)" in words
    )
    assert f"{SESSION} is not started again: a session cannot be resurrected; the" in words
    assert words.index(f"start {DM}") < words.index(SESSION) < words.index(f"start {SHELL}")


def test_a_display_manager_listed_as_a_systemd_holder_is_one_unit(make_sim):
    """The simulated host's display manager may be a listed systemd holder (as the
    `[[sessions]]` of issue 19's detection have it): stopped and started by either name,
    it is one unit, stopped once for the claim and back after its release."""
    listed = holder("systemd", "gdm.service", ["gpu0"], preemptible=True)
    sim = make_sim(host=HOST + listed, config=CONFIG)
    arbiter = build_arbiter(load_config(sim.config_path, environ={}))
    plan = arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert [str(step.holder) for step in plan.stops][-1] == DM
    assert "systemd:gdm.service" not in [str(step.holder) for step in plan.stops]
    assert not running(sim, "systemd:gdm.service")
    sim.stopped("libvirt:win11")
    arbiter.release_claimant("libvirt:win11")
    assert running(sim, "systemd:gdm.service")
    assert arbiter.ledger.read().leases == ()
