"""Sleep locks: a logind inhibitor lock per passed-through GPU, held by a transient unit.

While an exclusive lease is active the arbiter holds, for each of its tokens, a lock
of `what=sleep`, `who=charly-arbiter`, `mode=block`, saying why ("gpu0 is passed
through to libvirt:win11"): a host that suspends with a GPU given to a VM loses the
VM's GPU (vfio-pci does not bring a passed-through device back through a suspend).

The lock belongs to a process: `systemd-inhibit` holds it for as long as the command
it runs, here `sleep infinity`.  That process must outlive the arbiter's (a hook's
process ends as soon as the VM may start), so it runs as a transient unit of its own,
started by `systemd-run` and named after the token
(`charly-arbiter-inhibit-gpu0.service`): systemd keeps it, `systemctl stop` ends it
(and with it the lock), and a unit named after its token is found again after a
crash by any later process.  `--collect` lets a unit that failed (logind was not
there) go away by itself.  The unit's description is the lock's why, so that one
`systemctl list-units` says which locks are held and why.

Every program runs by absolute path, with its own deadline (the configuration's
holder start and stop timeouts, as for any unit).  A host without systemd running
(no /run/systemd/system, the check of sd_booted(3)) or without these programs
cannot hold a lock: `inhibit` raises `HostError` with why, which the arbiter logs
and records instead of failing the claim, and `doctor` says so.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

from charly_arbiter.errors import CommandFailed, HostError
from charly_arbiter.host import run

log = logging.getLogger(__name__)

UNIT_PREFIX = "charly-arbiter-inhibit-"
UNIT_SUFFIX = ".service"
WHO = "charly-arbiter"
PROGRAMS = ("systemd-run", "systemctl", "systemd-inhibit", "sleep")
# A token's name as it may appear in a unit's name (letters, digits, - _ . and the
# colons of a token named after its PCI address).
_TOKEN = re.compile(r"[A-Za-z0-9:_.-]+")
NOT_LOADED = 5  # systemctl's exit code for a unit that is not loaded (LSB "not installed")


def unit_of(token: str) -> str:
    """The transient unit that holds `token`'s sleep lock."""
    if _TOKEN.fullmatch(token) is None:
        raise HostError(f"{token}: a sleep lock's unit cannot be named after this token")
    return f"{UNIT_PREFIX}{token}{UNIT_SUFFIX}"


def token_of(unit: str) -> str | None:
    """The token a sleep lock's unit is named after (None: not such a unit)."""
    if not (unit.startswith(UNIT_PREFIX) and unit.endswith(UNIT_SUFFIX)):
        return None
    token = unit[len(UNIT_PREFIX) : -len(UNIT_SUFFIX)]
    return token if _TOKEN.fullmatch(token) else None


class SleepLocks:
    """The local host's sleep locks, through systemd-run, systemd-inhibit and systemctl."""

    def __init__(
        self,
        run_root: Path,
        start_timeout: float,
        stop_timeout: float,
        which: Callable[[str], str | None] = run.which,
    ) -> None:
        self.run_root = run_root
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.programs = {name: which(name) for name in PROGRAMS}

    def unavailable(self) -> str | None:
        """Why this host cannot hold a sleep lock (None: it can)."""
        if not (self.run_root / "systemd" / "system").is_dir():
            return (
                f"systemd is not running here ({self.run_root / 'systemd' / 'system'} is missing)"
            )
        missing = [name for name, path in self.programs.items() if path is None]
        if missing:
            return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed"
        return None

    def inhibit(self, token: str, why: str) -> None:
        """Start the unit that holds `token`'s lock.  A unit of that name left by an
        earlier lock (a crash) is stopped first, so the lock says this `why`."""
        unit = unit_of(token)
        problem = self.unavailable()
        if problem is not None:
            raise HostError(f"{token}: cannot block sleep: {problem}")
        argv = [
            self._program("systemd-run"),
            f"--unit={unit}",
            "--collect",
            "--quiet",
            f"--description={why}",
            "--",
            self._program("systemd-inhibit"),
            "--what=sleep",
            f"--who={WHO}",
            f"--why={why}",
            "--mode=block",
            self._program("sleep"),
            "infinity",
        ]
        try:
            run.run(argv, timeout=self.start_timeout)
        except CommandFailed as first:
            if unit not in self._listed():
                raise HostError(f"{token}: cannot block sleep: {first}") from first
            log.info("%s: %s is there already; starting it again", token, unit)
            self.uninhibit(token)
            try:
                run.run(argv, timeout=self.start_timeout)
            except CommandFailed as error:
                raise HostError(f"{token}: cannot block sleep: {error}") from error
        log.info("%s: sleep blocked (%s): %s", token, unit, why)

    def uninhibit(self, token: str) -> None:
        """Stop the unit holding `token`'s lock; nothing when there is none."""
        unit = unit_of(token)
        if self.programs["systemctl"] is None:
            return  # nothing could have started one
        try:
            run.run(
                [self._program("systemctl"), "stop", "--", unit],
                ok_codes=(0, NOT_LOADED),
                timeout=self.stop_timeout,
            )
        except CommandFailed as error:
            raise HostError(f"{token}: cannot let go of its sleep lock: {error}") from error

    def inhibitors(self) -> dict[str, str]:
        """token -> why, for every lock's unit that is active now."""
        return {
            token: why
            for unit, (active, why) in self._listed().items()
            if active == "active" and (token := token_of(unit)) is not None
        }

    def _listed(self) -> dict[str, tuple[str, str]]:
        """unit -> (its active state, its description), for every loaded lock unit."""
        if self.programs["systemctl"] is None or self.unavailable() is not None:
            return {}
        try:
            result = run.run(
                [
                    self._program("systemctl"),
                    "list-units",
                    "--all",
                    "--plain",
                    "--no-legend",
                    "--full",
                    "--no-pager",
                    "--",
                    f"{UNIT_PREFIX}*{UNIT_SUFFIX}",
                ],
                timeout=self.stop_timeout,
            )
        except CommandFailed as error:
            raise HostError(f"cannot list the sleep locks: {error}") from error
        found = {}
        for line in result.stdout.splitlines():
            # UNIT LOAD ACTIVE SUB DESCRIPTION (the description may have spaces)
            fields = line.split(None, 4)
            if len(fields) >= 4:
                found[fields[0]] = (fields[2], fields[4] if len(fields) == 5 else "")
        return found

    def _program(self, name: str) -> str:
        path = self.programs[name]
        if path is None:
            raise HostError(f"cannot block sleep: {name} is not installed")
        return path
