"""The holders a screen's release stops (`screen = "release"`): the display manager,
the logind sessions on the GPU, and the user units of their users that hold it.

They are not listed in arbiter.toml: the planner finds them in `Host.screen` and
names them `display-manager:UNIT`, `session:ID` and `systemd-user:UID/UNIT`; this
source stops them, says whether they run, and brings back what can come back:

- a user unit is stopped through its user's manager (`systemctl --user
  --machine=UID@.host`), and started again only while that manager runs (a user who
  lingers); otherwise it comes back with the user's next login;
- a session is told why before it ends (`tell`: a desktop notification through the
  user's bus), then ended with `loginctl terminate-session`; it is never started
  again: a session cannot be resurrected, the display manager's login screen is
  what comes back;
- the display manager is stopped with `systemctl stop`, and started again once its
  GPU is home, then checked: its unit active and a process holding a DRM card
  within `timeouts.screen_back`.  One that does not come up is not left restarting
  in a loop: it is stopped and its failed state reset, its last journal lines are
  read, and a text login (`getty@TTY.service`, on the virtual terminal in front,
  else tty1) takes its place; `DisplayManagerFailed` carries all of it.

Every command runs through host/run.py, by absolute path, with `--` before names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import Holder, TokenSpec
from charly_arbiter.core.model import Claimant, HolderKind
from charly_arbiter.errors import CommandFailed, DisplayManagerFailed, HolderError
from charly_arbiter.host import run
from charly_arbiter.host.procscan import scan
from charly_arbiter.host.sysfs import HOST_ROOTS, Roots

log = logging.getLogger(__name__)

SYSTEMCTL = "/usr/bin/systemctl"
LOGINCTL = "/usr/bin/loginctl"
JOURNALCTL = "/usr/bin/journalctl"
BUSCTL = "/usr/bin/busctl"
JOURNAL_LINES = 20
JOURNAL_TIMEOUT = 10.0  # seconds: the journal is read for the history, never waited on long
TELL_TIMEOUT = 5.0
POLL = 0.5
FALLBACK_TTY = "tty1"


class DesktopHolders:
    """Display managers, sessions and user units (LocalHost routes all three kinds here)."""

    kind = HolderKind.DISPLAY_MANAGER

    def __init__(
        self,
        config: Config,
        roots: Roots = HOST_ROOTS,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.roots = roots
        self.clock = clock
        self.sleep = sleep

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        """None listed: the planner finds them through `Host.screen`."""
        return []

    # -- is it running ------------------------------------------------------------------

    def is_running(self, ref: Claimant) -> bool:
        kind, name = ref.kind, ref.name
        if kind is HolderKind.SESSION:
            # Until logind lets it go: a closing session may still have a compositor
            # dying with the card open, which would block the GPU's unbind.
            return self._session_field(name, "STATE") is not None
        if kind is HolderKind.SYSTEMD_USER:
            uid, unit = _user_unit(ref)
            return self._manager_runs(uid) and self._active(unit, user=uid)
        return self._active(_unit(ref))

    def _active(self, unit: str, user: int | None = None) -> bool:
        result = run.run(
            [SYSTEMCTL, *_user_args(user), "is-active", "--quiet", "--", unit],
            check=False,
            timeout=self.config.timeouts.holder_stop,
        )
        return result.returncode == 0

    def _manager_runs(self, uid: int) -> bool:
        """Whether the user's service manager runs: asking it through --machine=UID@
        otherwise starts it (a PAM session of its own)."""
        return self._active(f"user@{uid}.service")

    # -- stop ---------------------------------------------------------------------------

    def stop(self, ref: Claimant) -> None:
        timeout = self.config.timeouts.holder_stop
        if ref.kind is HolderKind.SESSION:
            self._command(ref, "stop", [LOGINCTL, "terminate-session", "--", ref.name], timeout)
            self._wait(lambda: not self.is_running(ref), timeout)
            if self.is_running(ref):
                raise HolderError(ref, "stop", f"it did not end within {timeout:g} s")
            return
        if ref.kind is HolderKind.SYSTEMD_USER:
            uid, unit = _user_unit(ref)
            if self._manager_runs(uid):
                argv = [SYSTEMCTL, *_user_args(uid), "stop", "--", unit]
                self._command(ref, "stop", argv, timeout)
            return
        self._command(ref, "stop", [SYSTEMCTL, "stop", "--", _unit(ref)], timeout)

    # -- start --------------------------------------------------------------------------

    def start(self, ref: Claimant) -> None:
        timeout = self.config.timeouts.holder_start
        if ref.kind is HolderKind.SESSION:
            log.info("%s: a session is not started again; the login screen takes its place", ref)
            return
        if ref.kind is HolderKind.SYSTEMD_USER:
            uid, unit = _user_unit(ref)
            if not self._manager_runs(uid):
                log.info("%s: the user's manager is gone; it comes back at their next login", ref)
                return
            self._command(ref, "start", [SYSTEMCTL, *_user_args(uid), "start", "--", unit], timeout)
            return
        self._start_display_manager(ref)

    def _start_display_manager(self, ref: Claimant) -> None:
        unit = _unit(ref)
        limit = self.config.timeouts.screen_back
        why = ""
        try:
            run.run([SYSTEMCTL, "start", "--", unit], timeout=self.config.timeouts.holder_start)
        except CommandFailed as error:
            why = f"`systemctl start {unit}` failed: {error}"
        if not why:
            self._wait(lambda: self._active(unit) and self._card_held(), limit)
            if not self._active(unit):
                why = f"it was not active {limit:g} s after its start"
            elif not self._card_held():
                why = f"no process of it held a DRM card {limit:g} s after its start"
        if not why:
            log.info("%s is back: active, a card held", ref)
            return
        journal = self._journal(unit)
        # Not left restarting in a loop (Restart=always), nor failed for the next start.
        for verb in ("stop", "reset-failed"):
            run.run([SYSTEMCTL, verb, "--", unit], check=False, timeout=60.0)
        console = self._text_login()
        log.error("%s did not come back: %s", ref, why)
        raise DisplayManagerFailed(ref, unit, why, journal, console)

    def _card_held(self) -> bool:
        """Whether some process has a DRM card node open (the display manager's greeter,
        or the compositor of a session it opened)."""
        cards = [str(path) for path in sorted((self.roots.dev / "dri").glob("card*"))]
        return bool(scan(self.roots.proc, cards))

    def _journal(self, unit: str) -> tuple[str, ...]:
        argv = [JOURNALCTL, f"--unit={unit}", "-n", str(JOURNAL_LINES), "--no-pager", "-o", "cat"]
        try:
            result = run.run(argv, check=False, timeout=JOURNAL_TIMEOUT)
        except CommandFailed as error:
            return (f"(its journal could not be read: {error})",)
        return tuple(line for line in result.stdout.splitlines() if line.strip())

    def _text_login(self) -> str | None:
        """A getty on the virtual terminal in front (where the screen was), else tty1."""
        tty = self._active_tty() or FALLBACK_TTY
        try:
            run.run([SYSTEMCTL, "start", "--", f"getty@{tty}.service"], timeout=60.0)
        except CommandFailed as error:
            log.error("could not start a text login on %s: %s", tty, error)
            return None
        return tty

    def _active_tty(self) -> str | None:
        try:
            active = (self.roots.sys / "class" / "tty" / "tty0" / "active").read_text().strip()
        except OSError:
            return None
        number = active.removeprefix("tty")
        return active if active.startswith("tty") and number.isdigit() and number != "0" else None

    # -- telling a session why -------------------------------------------------------------

    def tell(self, sessions: Sequence[Claimant], message: str) -> None:
        """A desktop notification (org.freedesktop.Notifications) to each session's
        user, through their bus; a session with no notification daemon (a bare
        compositor) is not told: that is logged, never raised."""
        for session in sessions:
            uid = self._session_field(session.name, "UID")
            if uid is None or not uid.isdigit():
                continue
            argv = [
                BUSCTL,
                *_user_args(int(uid)),
                "call",
                "--",
                "org.freedesktop.Notifications",
                "/org/freedesktop/Notifications",
                "org.freedesktop.Notifications",
                "Notify",
                "susssasa{sv}i",
                "charly-arbiter",
                "0",
                "",
                "This session is about to end",
                message,
                "0",
                "0",
                "0",
            ]
            try:
                run.run(argv, timeout=TELL_TIMEOUT)
            except CommandFailed as error:
                log.warning("%s could not be told why (%s): %s", session, message, error)

    # -- helpers ----------------------------------------------------------------------------

    def _session_field(self, session: str, key: str) -> str | None:
        """A field of /run/systemd/sessions/ID (None: no such session)."""
        path = self.roots.run / "systemd" / "sessions" / session
        try:
            text = path.read_text()
        except OSError:
            return None
        for line in text.splitlines():
            name, sep, value = line.partition("=")
            if sep and name == key:
                return value
        return ""

    def _command(self, ref: Claimant, verb: str, argv: list[str], timeout: float) -> None:
        try:
            run.run(argv, timeout=timeout)
        except CommandFailed as error:
            raise HolderError(ref, verb, str(error)) from error

    def _wait(self, done: Callable[[], bool], limit: float) -> None:
        deadline = self.clock() + limit
        while not done() and self.clock() < deadline:
            self.sleep(POLL)


def _user_args(uid: int | None) -> list[str]:
    return [] if uid is None else ["--user", f"--machine={uid}@.host"]


def _user_unit(ref: Claimant) -> tuple[int, str]:
    uid, _, unit = ref.name.partition("/")
    return int(uid), unit


def _unit(ref: Claimant) -> str:
    if ref.kind is not HolderKind.DISPLAY_MANAGER:
        raise HolderError(ref, "handle", "it is not a display manager")
    return ref.name
