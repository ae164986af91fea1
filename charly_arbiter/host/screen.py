"""Who uses a GPU's screen: the boot display, the framebuffer console, and the people.

A token drives a screen when the firmware booted on it (`boot_vga`), when fbcon
draws on its framebuffer (see console.py), or when processes of the screen have
its DRM nodes open.  Those are found by one scan of /proc (procscan) for the
token's `dri/card*` and `dri/renderD*` nodes, and each is placed:

- its logind session: `/proc/PID/sessionid` (the audit session, which logind
  uses as its id), else its cgroup's `session-ID.scope`; the session's
  `/run/systemd/sessions/ID` says SEAT=, TYPE=, CLASS=, UID=, USER=, LEADER=;
- its unit: the deepest `.service`/`.scope` of its cgroup (`/proc/PID/cgroup`, the
  unified hierarchy's line, else name=systemd's), a user unit as
  `user@UID.service/app.slice/X.service`;
- the display manager that opened a session: a unit with `PAMName=` opens a
  session of its own and logind moves its process into `session-N.scope`, which
  leaves the unit's own cgroup empty, so the cgroup cannot say.  The session's
  leader still has the INVOCATION_ID systemd gave the unit in its environment,
  and `/run/systemd/units/invocation:UNIT` links to that id (seen with real
  systemd 252 and weston under `PAMName=login`: issue 19's finding F1).  The
  session file's `SERVICE=` is the PAM service ("login", "gdm-password"), not
  the unit.  Where the leader has no such id, the unit of the leader's parent is
  taken, if it is a system service.

Which processes are the screen's: those of a graphical (x11, wayland, mir) or
seated session, of the display manager's unit, and of the user units of a user
with such a session (`user@1000.service: pipewire.service`); and a display server
(console.DISPLAY_SERVERS: Xorg, weston, cage, ...) with a card (KMS) node open
wherever it runs (lightdm's Xorg in lightdm.service, a kiosk's cage in a unit of
its own).  A system service that has the card or a render node open (an inference
server), or an SSH login that renders on the GPU, is not the screen: it is a
holder like any other (holders/process.py; tests/kernel/test_systemd_units.py's
card holder is one).  Nor are logind and PID 1, which hold a session's card for it
(logind opens it for the compositor, TakeDevice, and keeps the fd in PID 1's fd
store: seen with systemd 252).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.core.host import ScreenProcess, ScreenSession, ScreenUse, TokenSpec
from charly_arbiter.host.console import DISPLAY_SERVERS, Console
from charly_arbiter.host.pcidata import function_nodes
from charly_arbiter.host.procscan import program_name, scan
from charly_arbiter.host.sysfs import Roots, Sysfs

GRAPHICAL = frozenset({"x11", "wayland", "mir"})
NO_SESSION = "4294967295"  # (uint32) -1: /proc/PID/sessionid of a process in no audit session
# Session classes that are no person's screen: a user's service manager (systemd
# 256 and later open a session for user@.service).
MANAGER_CLASSES = frozenset({"manager", "manager-early", "background", "background-light"})
_ENVIRON_MAX = 1 << 20
# Hold a session's devices on its behalf: no one's screen of their own.
DEVICE_BROKERS = frozenset({"systemd-logind.service", "init.scope"})


@dataclass(frozen=True)
class _Found:
    """A process with DRM nodes of the token open, placed."""

    pid: int
    comm: str
    uid: int
    nodes: tuple[str, ...]
    session: ScreenSession | None
    unit: str | None
    program: str  # the executable's name, untruncated

    @property
    def card(self) -> bool:
        return any(node.startswith("card") for node in self.nodes)

    @property
    def server(self) -> bool:
        """A display server with the card open (wherever it runs)."""
        return self.card and self.program in DISPLAY_SERVERS

    @property
    def user_unit_of(self) -> int | None:
        """The uid whose service manager runs it (`user@UID.service/...`)."""
        head = (self.unit or "").split("/", 1)[0]
        if head.startswith("user@") and head.endswith(".service"):
            number = head[len("user@") : -len(".service")]
            return int(number) if number.isdigit() else None
        return None


class ScreenReader:
    """Reads `ScreenUse` of tokens under the given roots (/sys, /proc, /dev, /run)."""

    def __init__(self, sysfs: Sysfs, roots: Roots, console: Console) -> None:
        self.sysfs = sysfs
        self.roots = roots
        self.console = console

    def of(self, token: TokenSpec) -> ScreenUse:
        display = self.console.of(token)
        nodes = self._drm_nodes(token)
        found = self._processes(nodes)
        screen = self._screens(found)
        sessions = tuple(dict.fromkeys(f.session for f in screen if f.session is not None).keys())
        return ScreenUse(
            token.name,
            boot_vga=bool(display.boot_vga),
            fbcon=bool(display.framebuffers and display.consoles),
            processes=tuple(
                ScreenProcess(
                    f.pid, f.comm, f.uid, f.nodes, f.session.id if f.session else None, f.unit
                )
                for f in screen
            ),
            sessions=sessions,
            display_manager=_display_manager(screen, sessions),
            user_units=tuple(
                dict.fromkeys(
                    f"user@{f.user_unit_of}.service: {(f.unit or '').rsplit('/', 1)[-1]}"
                    for f in screen
                    if f.user_unit_of is not None
                )
            ),
        )

    # -- reading ---------------------------------------------------------------------

    def _drm_nodes(self, token: TokenSpec) -> dict[str, str]:
        """The token's DRM nodes that exist now: path -> node name (`card0`)."""
        found: dict[str, str] = {}
        for function in token.functions:
            nodes = function_nodes(self.sysfs, self.roots.dev, self.roots.proc, function)
            for path, kind in nodes.items():
                if kind.startswith("drm"):
                    found[path] = os.path.basename(path)
        return found

    def _processes(self, nodes: Mapping[str, str]) -> list[_Found]:
        held: dict[int, list[str]] = {}
        comms: dict[int, str] = {}
        for opened in scan(self.roots.proc, nodes):  # one scan for every node
            held.setdefault(opened.pid, []).append(nodes[opened.node])
            comms[opened.pid] = opened.comm
        sessions: dict[str, ScreenSession | None] = {}
        found = []
        for pid, names in sorted(held.items()):
            unit = self.unit_of(pid)
            if pid == 1 or unit in DEVICE_BROKERS:
                continue
            session_id = self._session_id(pid, unit)
            session = None
            if session_id is not None:
                if session_id not in sessions:
                    sessions[session_id] = self.session(session_id)
                session = sessions[session_id]
            names_held = tuple(sorted(set(names)))
            program = program_name(self.roots.proc, pid)
            found.append(
                _Found(pid, comms[pid], self._uid(pid), names_held, session, unit, program)
            )
        return found

    def _screens(self, found: list[_Found]) -> list[_Found]:
        """The processes that are the screen's (see the module's docstring)."""
        seated = {
            f.session.id
            for f in found
            if f.session is not None and (f.server or _is_screen_session(f.session))
        }
        screen_sessions = {
            f.session.id: f.session for f in found if f.session and f.session.id in seated
        }
        units = {s.display_manager for s in screen_sessions.values() if s.display_manager}
        users = {s.uid for s in screen_sessions.values()}
        kept = []
        for f in found:
            if (
                f.server
                or (f.session is not None and f.session.id in seated)
                or (f.unit is not None and f.unit in units)
                or (f.user_unit_of is not None and f.user_unit_of in users)
            ):
                kept.append(f)
        return kept

    def session(self, session_id: str) -> ScreenSession | None:
        """`/run/systemd/sessions/ID` (None: logind knows no such session)."""
        if not _safe_name(session_id):
            return None
        fields = _env_file(self.roots.run / "systemd" / "sessions" / session_id)
        if fields is None or fields.get("CLASS", "user") in MANAGER_CLASSES:
            return None
        leader = _int(fields.get("LEADER"), 0)
        return ScreenSession(
            session_id,
            seat=fields.get("SEAT") or None,
            type=fields.get("TYPE") or "unspecified",
            uid=_int(fields.get("UID"), -1),
            user=fields.get("USER", ""),
            leader=leader,
            display_manager=self.opened_by(leader) if leader > 0 else None,
        )

    def opened_by(self, leader: int) -> str | None:
        """The system unit that opened the session `leader` leads: by the leader's
        INVOCATION_ID (finding F1), else the system service its parent runs in."""
        invocation = self._environ(leader).get("INVOCATION_ID")
        if invocation:
            unit = self._invocations().get(invocation)
            if unit is not None:
                return unit
        for pid in (leader, self._parent(leader)):
            unit = self.unit_of(pid) if pid else None
            if unit is not None and unit.endswith(".service") and "/" not in unit:
                return unit
        return None

    def unit_of(self, pid: int) -> str | None:
        """The unit `pid` runs in, from its cgroup (None: none, or it is gone)."""
        try:
            text = (self.roots.proc / str(pid) / "cgroup").read_text()
        except OSError:
            return None
        paths = {}
        for line in text.splitlines():
            number, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if number == "0" and controllers == "":
                paths["unified"] = path
            elif controllers == "name=systemd":
                paths["systemd"] = path
        chosen = paths.get("unified") or paths.get("systemd")
        return unit_of_cgroup(chosen) if chosen else None

    def _session_id(self, pid: int, unit: str | None) -> str | None:
        if unit is not None and unit.startswith("user@"):
            return None  # a user unit: in its user's service manager, in no person's session
        try:
            audit = (self.roots.proc / str(pid) / "sessionid").read_text().strip()
        except OSError:
            audit = ""
        known = self.roots.run / "systemd" / "sessions" / audit
        if audit.isdigit() and audit != NO_SESSION and known.is_file():
            return audit
        if unit is not None and unit.startswith("session-") and unit.endswith(".scope"):
            return unit[len("session-") : -len(".scope")]
        return None

    def _uid(self, pid: int) -> int:
        for line in _lines(self.roots.proc / str(pid) / "status"):
            if line.startswith("Uid:"):
                fields = line.split()
                return _int(fields[1] if len(fields) > 1 else None, -1)
        return -1

    def _parent(self, pid: int) -> int:
        for line in _lines(self.roots.proc / str(pid) / "status"):
            if line.startswith("PPid:"):
                return _int(line.split()[-1], 0)
        return 0

    def _environ(self, pid: int) -> dict[str, str]:
        try:
            with (self.roots.proc / str(pid) / "environ").open("rb") as handle:
                raw = handle.read(_ENVIRON_MAX)
        except OSError:
            return {}
        found = {}
        for entry in raw.split(b"\0"):
            key, equals, value = entry.partition(b"=")
            if equals:
                found[key.decode(errors="replace")] = value.decode(errors="replace")
        return found

    def _invocations(self) -> dict[str, str]:
        """invocation id -> unit, from /run/systemd/units/invocation:UNIT links."""
        directory = self.roots.run / "systemd" / "units"
        try:
            entries = os.listdir(directory)
        except OSError:
            return {}
        found = {}
        for entry in entries:
            if not entry.startswith("invocation:"):
                continue
            try:
                target = os.readlink(directory / entry)
            except OSError:
                continue
            found[os.path.basename(target)] = entry[len("invocation:") :]
        return found


def unit_of_cgroup(path: str) -> str | None:
    """The unit a cgroup path is in: `/system.slice/gdm.service` -> gdm.service,
    `/user.slice/user-1000.slice/session-3.scope` -> session-3.scope,
    `/user.slice/user-1000.slice/user@1000.service/app.slice/x.service` ->
    user@1000.service/app.slice/x.service (None: a slice, the root, init.scope's parent)."""
    parts = [part for part in path.split("/") if part]
    for index, part in enumerate(parts):
        if part.startswith("user@") and part.endswith(".service"):
            tail = [p for p in parts[index:] if p.endswith((".service", ".scope", ".slice"))]
            deepest = max(
                (i for i, p in enumerate(tail) if p.endswith((".service", ".scope"))), default=0
            )
            return "/".join(tail[: deepest + 1])
    units = [part for part in parts if part.endswith((".service", ".scope"))]
    return units[-1] if units else None


def _display_manager(screen: Collection[_Found], sessions: Collection[ScreenSession]) -> str | None:
    """The display manager: the unit that opened a graphical or seated session, else
    a system service whose display server has the card open (Xorg in lightdm.service)."""
    for session in sessions:
        if session.display_manager and _is_screen_session(session):
            return session.display_manager
    for found in screen:
        unit = found.unit or ""
        if found.server and found.session is None and unit.endswith(".service") and "/" not in unit:
            return unit
    return None


def _is_screen_session(session: ScreenSession) -> bool:
    return session.type in GRAPHICAL or session.seat is not None


def _safe_name(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "-_." for c in name) and name not in (".", "..")


def _env_file(path: Path) -> dict[str, str] | None:
    """A `KEY=VALUE` file as systemd writes its run-time state (None: absent)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        key, equals, value = line.partition("=")
        if equals and not key.startswith("#"):
            found[key.strip()] = value.strip()
    return found


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default
