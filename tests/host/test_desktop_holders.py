"""The local host's side of `screen = "release"` (host/holders/desktop.py): the commands
it runs, faked at the outermost seam (host/run.run), over a fake /run, /sys and /dev
with real processes holding a card.

Under a real systemd, logind and weston these run in the guest of tests/kernel (the
issue's Proof, tests/kernel/test_desktop.py); here their faults are quicker to meet:
a display manager that never gets active, one active without drawing, a desktop
with no notification daemon."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from charly_arbiter.core.config import Config, Timeouts
from charly_arbiter.core.model import Claimant
from charly_arbiter.errors import DisplayManagerFailed
from charly_arbiter.host import run
from charly_arbiter.host.holders.desktop import DesktopHolders
from charly_arbiter.host.sysfs import Roots

DM = Claimant.parse("display-manager:gdm.service")
SESSION = Claimant.parse("session:3")
SHELL = Claimant.parse("systemd-user:1000/org.gnome.Shell@wayland.service")
SYSTEMCTL, LOGINCTL = "/usr/bin/systemctl", "/usr/bin/loginctl"
USER = ["--user", "--machine=1000@.host"]


class Systemd:
    """What systemctl, loginctl, journalctl and busctl answer: which units are active,
    what a start does (`comes_up`: the unit gets active and `on_start` runs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ran: list[list[str]] = []
        self.active = {"gdm.service", "user@1000.service", "org.gnome.Shell@wayland.service"}
        self.comes_up = True
        self.draws = True  # the display manager, once up, holds the card
        self.on_start: list[subprocess.Popen[bytes]] = []
        self.card = root / "dev" / "dri" / "card0"
        self.notify_fails = False

    def __call__(self, argv, *, check=True, ok_codes=(0,), timeout=60.0, input_text=None):
        argv = list(argv)
        self.ran.append(argv)
        words = [w for w in argv[1:] if not w.startswith("-")]
        code, out = 0, ""
        if argv[0] == SYSTEMCTL:
            verb, unit = words[0], words[-1]
            if verb == "is-active":
                code = 0 if unit in self.active else 3
            elif verb == "start" and unit == "gdm.service" and self.comes_up:
                self.active.add(unit)
                if self.draws:
                    self.on_start.append(hold(self.card))
            elif verb == "start":
                self.active.add(unit) if unit != "gdm.service" else None
            elif verb == "stop":
                self.active.discard(unit)
        elif argv[0] == LOGINCTL:
            (self.root / "run" / "systemd" / "sessions" / words[-1]).unlink()
        elif argv[0].endswith("journalctl"):
            out = "gdm.service: Failed to open /dev/dri/card0\nFailed with result 'exit-code'.\n"
        elif argv[0].endswith("busctl") and self.notify_fails:
            code = 1
        result = run.Completed(code, out, "")
        if check and code not in ok_codes:
            from charly_arbiter.errors import CommandFailed

            raise CommandFailed(argv, code, "no such name")
        return result


def hold(node: Path) -> subprocess.Popen[bytes]:
    """A real process with `node` open (a compositor holding its card)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys,time; f=open({str(node)!r}); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == b"1"
    return child


@pytest.fixture
def desk(tmp_path, monkeypatch):
    (tmp_path / "dev" / "dri").mkdir(parents=True)
    (tmp_path / "dev" / "dri" / "card0").write_text("")
    sessions = tmp_path / "run" / "systemd" / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "3").write_text("UID=1000\nUSER=alice\nSTATE=active\nTYPE=wayland\n")
    tty = tmp_path / "sys" / "class" / "tty" / "tty0"
    tty.mkdir(parents=True)
    (tty / "active").write_text("tty7\n")
    systemd = Systemd(tmp_path)
    monkeypatch.setattr(run, "run", systemd)
    roots = Roots(
        sys=tmp_path / "sys", proc=Path("/proc"), dev=tmp_path / "dev", run=tmp_path / "run"
    )
    config = replace(Config(), timeouts=Timeouts(screen_back=0.3, holder_stop=1.0))
    holders = DesktopHolders(config, roots, sleep=lambda seconds: None)
    yield holders, systemd
    for child in systemd.on_start:
        child.kill()
        child.wait()


def test_a_session_is_ended_by_logind_and_waited_for(desk):
    holders, systemd = desk
    assert holders.is_running(SESSION)
    holders.stop(SESSION)
    assert systemd.ran == [[LOGINCTL, "terminate-session", "--", "3"]]
    assert not holders.is_running(SESSION)
    holders.start(SESSION)  # never started again
    assert systemd.ran == [[LOGINCTL, "terminate-session", "--", "3"]]


def test_a_user_unit_goes_through_its_users_manager_and_only_while_it_runs(desk):
    holders, systemd = desk
    holders.stop(SHELL)
    unit = "org.gnome.Shell@wayland.service"
    assert systemd.ran == [
        [SYSTEMCTL, "is-active", "--quiet", "--", "user@1000.service"],
        [SYSTEMCTL, *USER, "stop", "--", unit],
    ]
    systemd.ran.clear()
    systemd.active.discard("user@1000.service")  # the session ended, the user's manager too
    holders.start(SHELL)
    # Not asked through --machine=1000@: that would start the manager (a PAM session).
    assert systemd.ran == [[SYSTEMCTL, "is-active", "--quiet", "--", "user@1000.service"]]
    assert not holders.is_running(SHELL)


def test_the_display_manager_is_back_once_active_and_holding_a_card(desk):
    holders, systemd = desk
    holders.stop(DM)
    assert systemd.ran[-1] == [SYSTEMCTL, "stop", "--", "gdm.service"]
    holders.start(DM)
    assert [SYSTEMCTL, "start", "--", "gdm.service"] in systemd.ran
    assert not any(argv[0].endswith("journalctl") for argv in systemd.ran)


@pytest.mark.parametrize("fault", ["never active", "active, drawing nothing"])
def test_a_display_manager_that_does_not_come_up_ends_on_a_text_login(desk, fault):
    holders, systemd = desk
    holders.stop(DM)
    if fault == "never active":
        systemd.comes_up = False
    else:
        systemd.draws = False
    systemd.ran.clear()
    with pytest.raises(DisplayManagerFailed) as failed:
        holders.start(DM)
    error = failed.value
    assert error.console == "tty7" and error.unit == "gdm.service"
    assert error.journal == (
        "gdm.service: Failed to open /dev/dri/card0",
        "Failed with result 'exit-code'.",
    )
    why = "it was not active" if fault == "never active" else "no process of it held a DRM card"
    assert why in str(error) and "no restart loop" in str(error) and "tty7" in str(error)
    assert "journalctl -u gdm.service" in (error.hint or "")
    after = [argv for argv in systemd.ran if argv[1:3] != ["is-active", "--quiet"]]
    assert after[1:] == [
        ["/usr/bin/journalctl", "--unit=gdm.service", "-n", "20", "--no-pager", "-o", "cat"],
        [SYSTEMCTL, "stop", "--", "gdm.service"],
        [SYSTEMCTL, "reset-failed", "--", "gdm.service"],
        [SYSTEMCTL, "start", "--", "getty@tty7.service"],
    ]
    assert "gdm.service" not in systemd.active


def test_the_text_login_goes_to_tty1_when_no_terminal_is_in_front(desk):
    holders, systemd = desk
    (holders.roots.sys / "class" / "tty" / "tty0" / "active").unlink()
    systemd.comes_up = False
    with pytest.raises(DisplayManagerFailed) as failed:
        holders.start(DM)
    assert failed.value.console == "tty1"
    assert systemd.ran[-1] == [SYSTEMCTL, "start", "--", "getty@tty1.service"]


def test_a_session_is_told_why_through_its_users_bus_and_a_refusal_is_only_logged(desk, caplog):
    holders, systemd = desk
    holders.tell([SESSION], "gpu0 is given to libvirt:win11")
    (call,) = systemd.ran
    assert call[:5] == ["/usr/bin/busctl", *USER, "call", "--"]
    assert "org.freedesktop.Notifications" in call and "gpu0 is given to libvirt:win11" in call
    systemd.notify_fails = True
    holders.tell([SESSION, Claimant.parse("session:99")], "why")  # 99: no such session
    assert len(systemd.ran) == 2
    assert "session:3 could not be told why" in caplog.text


def test_a_closing_session_still_runs_until_logind_lets_it_go(desk):
    """Its compositor may still be dying with the card open: the stop waits it out."""
    holders, _ = desk
    path = holders.roots.run / "systemd" / "sessions" / "3"
    path.write_text("UID=1000\nSTATE=closing\n")
    assert holders.is_running(SESSION)
    path.unlink()
    assert not holders.is_running(SESSION)
