"""The event history: a bounded, crash-safe, append-only JSON-lines log.

It lives in the state directory (`history.jsonl`, then `history.jsonl.1` …
after rotation).  Each event is one line written by a single `O_APPEND` write,
under a small flock (`history.lock`) that also serialises rotation, so
concurrent writers (the CLI and a VM's hook) never interleave.  An event that
begins an action on the host (which may hang it), says that something failed
or was refused, or records an operator's act is fsynced, and with it every line
before it; the routine record of a step whose outcome the ledger already holds
durably (`ROUTINE`: `switched`, `active`, `restored` …) is not.  A killed
process loses no line either way (the kernel has it); a power cut may lose the
routine lines written since the last fsync, never the record of the action
that was under way (an exclusive claim and its release wrote 13 fsyncs here,
now 4; each is 0.2-0.3 ms on a virtual disk).

A line can still be torn by a power cut or a full disk.  Reading skips such a
line with a note instead of failing, and the next append starts on a fresh
line, so one torn record never spoils the ones after it.  The log is bounded:
when the live file would grow past `max_bytes` it is rotated, and only `keep`
old files are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from charly_arbiter.core import files
from charly_arbiter.core.crashpoints import crashpoint
from charly_arbiter.core.events import STEP_STARTS, EventKind
from charly_arbiter.errors import ArbiterError, UsageError
from charly_arbiter.host.procscan import alive as process_runs
from charly_arbiter.host.sysfs import HOST_ROOTS

log = logging.getLogger(__name__)

HISTORY = "history.jsonl"
LOCK = "history.lock"
MAX_BYTES = 1 << 20
KEEP = 3
LOCK_WAIT = 10.0  # an event is never worth hanging a hook for
# How much of the newest history is read for the ledger generation it recorded last
# (every claim or hook asks: a bounded read, never the whole log).
TAIL_BYTES = 64 << 10
_GENERATION = re.compile(rb'"generation": (\d+)')
# Written without an fsync (the module's docstring says why): what a step's outcome
# or a decision the ledger has durably already looks like in the history.
ROUTINE = frozenset(
    {
        EventKind.CLAIM,
        EventKind.PREEMPTED,
        EventKind.SWITCHED,
        EventKind.ACTIVE,
        EventKind.RELEASE,
        EventKind.RESTORED,
        EventKind.MIG_DONE,
        EventKind.VF_COUNTED,
        EventKind.TOLD,
        EventKind.SESSION_ENDED,
        EventKind.SLEEP_BLOCKED,
        EventKind.SLEEP_ALLOWED,
    }
)


@dataclass(frozen=True)
class Record:
    """One event as read back: when, what, which process, and the event's fields."""

    time: datetime
    kind: str
    pid: int
    fields: Mapping[str, Any]

    def get(self, key: str) -> str:
        value = self.fields.get(key)
        return "" if value is None else str(value)

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(name for name in self.get("token").split(",") if name)

    def document(self) -> dict[str, Any]:
        return {
            "time": self.time.isoformat(timespec="milliseconds"),
            "event": self.kind,
            "pid": self.pid,
            **self.fields,
        }


@dataclass(frozen=True)
class Reading:
    records: tuple[Record, ...]
    notes: tuple[str, ...]  # torn or unreadable lines that were skipped


class HistoryLog:
    def __init__(self, state_dir: Path, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> None:
        self.state_dir = state_dir
        self.path = state_dir / HISTORY
        self.lock_path = state_dir / LOCK
        self.max_bytes = max_bytes
        self.keep = keep

    def files(self) -> list[Path]:
        """Oldest first: the rotated files, then the live one."""
        rotated = [self.rotated(n) for n in range(self.keep, 0, -1)]
        return [path for path in [*rotated, self.path] if path.exists()]

    def rotated(self, number: int) -> Path:
        return self.state_dir / f"{HISTORY}.{number}"

    # -- writing ------------------------------------------------------------------

    def append(self, kind: str, fields: Mapping[str, Any], when: datetime | None = None) -> None:
        """Write one event, durably unless it is ROUTINE; rotates first when the live
        file would be too big."""
        record = {
            "time": (when or datetime.now(UTC)).isoformat(timespec="milliseconds"),
            "event": kind,
            "pid": os.getpid(),
            **{key: _plain(value) for key, value in fields.items()},
        }
        line = (json.dumps(record, ensure_ascii=False, sort_keys=False) + "\n").encode()
        if not self.state_dir.is_dir():
            # The ledger creates the state directory; an event before it has nowhere to go.
            log.debug("no state directory %s; event %s not kept", self.state_dir, kind)
            return
        with self._locked():
            size = _size(self.path)
            if size and size + len(line) > self.max_bytes:
                self._rotate_unlocked()
                size = 0
            fd = files.open_checked(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
            try:
                if size and not _ends_with_newline(fd, size):
                    line = b"\n" + line  # a torn last line stays alone on its line
                crashpoint("history.write")
                written = os.write(fd, line)
                while written < len(line):  # a short write (full disk): finish the line
                    written += os.write(fd, line[written:])
                if kind not in ROUTINE:
                    crashpoint("history.fsync")
                    os.fsync(fd)
            finally:
                os.close(fd)

    def _rotate_unlocked(self) -> None:
        """history.jsonl -> .1 -> .2 …; the oldest beyond `keep` is dropped.

        Each rename is atomic, so a crash between them loses nothing but order
        within one rotation step, and the next append simply creates a new file.
        """
        self._fsync_live()  # its routine lines are durable before it is renamed
        self.rotated(self.keep).unlink(missing_ok=True)
        for number in range(self.keep - 1, 0, -1):
            if self.rotated(number).exists():
                os.replace(self.rotated(number), self.rotated(number + 1))
        crashpoint("history.rotate")
        if self.keep > 0:
            os.replace(self.path, self.rotated(1))
        else:
            self.path.unlink()
        files.fsync_dir(self.state_dir)

    def _fsync_live(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = files.open_checked(self.lock_path, os.O_RDWR | os.O_CREAT)
        try:
            if not files.lock_within(fd, LOCK_WAIT):
                raise ArbiterError(f"{self.lock_path} stayed locked for {LOCK_WAIT:g} s")
            yield
        finally:
            os.close(fd)  # which lets the flock go

    # -- reading ------------------------------------------------------------------

    def highest_generation(self) -> int:
        """The highest ledger generation the newest events recorded (0: none yet).

        Every event carries the generation its process saw last, a value the ledger
        really had then; a ledger never goes back, so one found below this was
        deleted or replaced (`Arbiter` refuses to act on it until `recover`).  Only
        the tail of the newest file that has any is read.  (A string value cannot
        match: json.dumps escapes the quotes inside it.)"""
        for path in reversed(self.files()):
            try:
                with path.open("rb") as handle:
                    size = handle.seek(0, os.SEEK_END)
                    handle.seek(max(0, size - TAIL_BYTES))
                    tail = handle.read(TAIL_BYTES)
            except OSError as error:
                log.warning("cannot read %s: %s", path, error.strerror)
                continue
            found = [int(match) for match in _GENERATION.findall(tail)]
            if found:
                return max(found)
        return 0

    def read(self) -> Reading:
        """Every record still kept, oldest first; torn lines become notes."""
        records: list[Record] = []
        notes: list[str] = []
        for path in self.files():
            try:
                data = path.read_bytes()
            except OSError as error:
                notes.append(f"{path}: cannot be read ({error.strerror}); skipped")
                continue
            for number, raw in enumerate(data.split(b"\n"), start=1):
                if not raw.strip():
                    continue
                record = _parse(raw)
                if record is None:
                    notes.append(f"{path} line {number}: not a complete record (torn?); skipped")
                else:
                    records.append(record)
        return Reading(tuple(records), tuple(notes))


def _parse(raw: bytes) -> Record | None:
    try:
        document = json.loads(raw)
        when = datetime.fromisoformat(document.pop("time"))
        kind = str(document.pop("event"))
        pid = int(document.pop("pid", 0))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return Record(when, kind, pid, document)


# -- questions over records ------------------------------------------------------------


def select(
    records: Iterable[Record],
    *,
    token: str | None = None,
    claimant: str | None = None,
    since: datetime | None = None,
) -> list[Record]:
    """Records about a token or a claimant, newer than `since`.

    A step (a stop, a switch) that does not name the token itself belongs to it
    when the same process recorded it for a claimant that claimed the token.
    """
    chosen = [record for record in records if since is None or record.time >= since]
    if token is not None:
        operations = {(r.pid, r.get("claimant")) for r in chosen if token in r.tokens}
        chosen = [
            r for r in chosen if token in r.tokens or (r.pid, r.get("claimant")) in operations
        ]
    if claimant is not None:
        chosen = [r for r in chosen if claimant in (r.get("claimant"), r.get("holder"))]
    return chosen


def interrupted(records: Sequence[Record], alive: Any = None) -> set[int]:
    """Indexes of step starts whose process died before finishing them.

    A process that finishes a step always records something after it (the
    completion, a failure or a poisoning), so a step start that is the last
    record of a process no longer alive is where that process was killed.
    `alive(pid)` answers whether a pid still runs (default: /proc, zombies dead).
    """
    is_alive = alive or (lambda pid: process_runs(HOST_ROOTS.proc, pid))
    last_of_pid: dict[int, int] = {}
    for index, record in enumerate(records):
        last_of_pid[record.pid] = index
    return {
        index
        for pid, index in last_of_pid.items()
        if records[index].kind in STEP_STARTS and not is_alive(pid)
    }


@dataclass(frozen=True)
class LastHolder:
    """Who the history says holds a token exclusively, its claim never ended: what a
    ledger that was lost (deleted, replaced) knew, and what its claim stopped."""

    claimant: str
    since: datetime
    stopped: tuple[str, ...]  # holders it stopped that no later event shows started again


def last_holder(records: Sequence[Record], token: str) -> LastHolder | None:
    """The last exclusive claim on `token` that no release, restore, failure, adoption
    or send-home ended, per the history; None when there is none (or no history).

    Only what the events say: holders its claim stopped (`preempted`) and that no
    `restored` brought back since.  Holders a preempted shared claimant had
    stopped before moved into the lease without an event of their own; they are
    not found here."""
    found: LastHolder | None = None
    for record in records:
        claimant = record.get("claimant")
        if (
            record.kind == EventKind.CLAIM
            and token in record.tokens
            and record.get("mode") == "exclusive"
        ):
            found = LastHolder(claimant, record.time, ())
        elif record.kind == EventKind.ADOPTED and token in record.tokens:
            stopped = tuple(h for h in record.get("stopped").split(", ") if h)
            adopted = claimant and record.get("by") != "administrator"
            found = LastHolder(claimant, record.time, stopped) if adopted else None
        elif found is None:
            continue
        elif record.kind == EventKind.PREEMPTED and claimant == found.claimant:
            holder = record.get("holder")
            if holder and holder not in found.stopped:
                found = LastHolder(found.claimant, found.since, (*found.stopped, holder))
        elif record.kind == EventKind.RESTORED and record.get("holder") in found.stopped:
            kept = tuple(h for h in found.stopped if h != record.get("holder"))
            found = LastHolder(found.claimant, found.since, kept)
        elif (
            record.kind in (EventKind.RELEASE, EventKind.RESTORE, EventKind.FAILED)
            and claimant == found.claimant
        ) or (record.kind == EventKind.SEND_HOME and token in record.tokens):
            found = None
    return found


_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """`30m`, `2h`, `1d`, `1w`, or an ISO date/time (local time when no zone is given)."""
    text = text.strip()
    relative = _RELATIVE.fullmatch(text)
    if relative:
        amount = float(relative.group(1))
        return (now or datetime.now(UTC)) - timedelta(**{_UNITS[relative.group(2)]: amount})
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"{text!r} is not a time",
            hint="give --since as 30m, 2h, 1d, 1w or an ISO date such as 2026-11-29T14:00",
        ) from None
    return when if when.tzinfo else when.astimezone()


# -- helpers ---------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Event fields as JSON values (an enum or a path becomes its text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def _ends_with_newline(fd: int, size: int) -> bool:
    return os.pread(fd, 1, size - 1) == b"\n"
