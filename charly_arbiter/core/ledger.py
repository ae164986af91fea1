"""The lease ledger: one locked, crash-safe TOML file in the state directory.

Writers take an flock on `ledger.lock`, a file that is never renamed or
removed (locking the data file itself would hand the next process a fresh,
unlocked inode after each rename).  Every write goes through a temp file,
fsync, a hard-linked `.bak` of the previous generation, `os.replace` and an
fsync of the directory, so a crash leaves either the old or the new
generation.  Readers (`status`) need no lock: a rename is atomic.

Only `transaction()` is public for writes; helpers that assume the lock is
held are named `…_unlocked`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from charly_arbiter.core import files, ledger_format
from charly_arbiter.core.crashpoints import crashpoint
from charly_arbiter.core.model import LedgerState
from charly_arbiter.errors import LedgerBusy, LedgerCorrupt, LedgerWriteFailed, StateDirUnsafe

log = logging.getLogger(__name__)

LEDGER = "ledger.toml"
BACKUP = "ledger.toml.bak"
LOCK = "ledger.lock"
TEMP = "ledger.toml.tmp"
CACHE = "ledger.cache.json"  # a JSON copy, used only for the ledger it was made from
# The copy is written for a ledger of this many bytes or more (some 15 leases):
# below it, parsing the TOML costs less than writing the copy at every write
# (0.2 ms for 1 KiB of TOML, against 0.25-0.3 ms to write a file and rename it).
CACHE_FROM = 4096
_POLL = 0.02

# The ledger this process decoded or wrote last, by its bytes: every Ledger of the
# process (a command, a hook and the explorer make several) reads the file again
# and skips the decoding when the bytes are the same; a spare of the resident
# helper fills it while it waits (`read_ahead`) for the command it then runs.
_last: tuple[bytes, LedgerState] | None = None


def forget_decoded() -> None:
    """Forget `_last` (for tests that change a ledger's JSON copy by hand)."""
    global _last
    _last = None


@dataclass
class Transaction:
    """The state as read under the lock; assign `state` to have it written."""

    state: LedgerState


@dataclass(frozen=True)
class Reading:
    """What a lock-free read found: the state, or why there is none."""

    state: LedgerState | None
    corrupt: LedgerCorrupt | None = None


class Ledger:
    def __init__(self, state_dir: Path, lock_timeout: float = 10.0) -> None:
        self.state_dir = state_dir
        self.path = state_dir / LEDGER
        self.backup = state_dir / BACKUP
        self.lock_path = state_dir / LOCK
        self.lock_timeout = lock_timeout
        # The bytes decoded last, and their state.
        self._decoded: tuple[bytes, LedgerState] | None = None
        # The generation of the ledger this process read or wrote last (None before
        # the first): every event records it, so the history can tell when the
        # ledger went backwards.
        self.generation_seen: int | None = None

    # -- reading ---------------------------------------------------------------

    def read(self) -> LedgerState:
        """The current state without taking the lock; raises `LedgerCorrupt`, or
        `StateDirError` when the host refuses the read (a permission)."""
        self._check_state_dir(create=False)
        with files.host_refusals(self.path, "read"):
            # The backup is looked at first: a ledger exists before its first backup
            # does and never goes away, so a backup seen *before* a missing ledger
            # means damage, while one seen after may just come from the first writes
            # running meanwhile.
            backup_existed = self.backup.exists()
            if self.path.exists() or self.path.is_symlink():
                return self._load_file(self.path)
        if backup_existed:
            raise LedgerCorrupt(self.path, f"it is missing but {self.backup} exists")
        self.generation_seen = 0
        return LedgerState()

    def read_ahead(self) -> int:
        """Decode the ledger now, for a later `read` in this process (or a fork of
        it) to use if its bytes are still the same (`_last`); the leases decoded.
        Nothing is trusted from it: the reader reads the bytes again, and any other
        bytes are decoded as usual.  Raises what `read` raises."""
        self._check_state_dir(create=False)
        with files.host_refusals(self.path, "read"):
            if not self.path.exists():
                return 0
            return len(self._load_file(self.path).leases)

    def inspect(self) -> Reading:
        """Like `read`, but reports corruption instead of raising (for `status`)."""
        try:
            return Reading(self.read())
        except LedgerCorrupt as error:
            return Reading(None, error)

    # -- writing ---------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Hold the lock, load the state, and write it back if it was changed.

        Keep the body short: never wait on the outside world inside it.  A
        corrupt or unsafe ledger raises before the body runs, so a mutating
        command fails closed and changes nothing.  The body may raise the
        generation (`recover`, past what the history recorded of a ledger that
        went backwards); it never lowers it.
        """
        self._check_state_dir(create=True)
        with self._locked():
            with files.host_refusals(self.path, "use"):
                txn = Transaction(self._load_for_update_unlocked())
            before = txn.state
            yield txn
            if txn.state != before:
                generation = max(before.generation, txn.state.generation) + 1
                self._write_unlocked(replace(txn.state, generation=generation))
        crashpoint("ledger.unlocked")

    def tidy(self) -> LedgerState:
        """Take the lock once: remove what an interrupted write left behind (`restore`
        runs this first, so it converges even when no lease needs it)."""
        with self.transaction() as txn:
            return txn.state

    def _load_for_update_unlocked(self) -> LedgerState:
        """The state to change, or `LedgerCorrupt`: a damaged ledger is never repaired
        here.  With temp+fsync+rename a crash never tears it, so damage means something
        else went wrong, and only an operator decides what the host really holds."""
        self._remove_stray_temp_unlocked()
        if not self.path.exists() and not self.path.is_symlink():
            if self.backup.exists():
                # A ledger never disappears on its own; its backup says it existed.
                raise LedgerCorrupt(self.path, f"it is missing but {self.backup} exists")
            self.generation_seen = 0
            return LedgerState()
        return self._load_file(self.path)

    # -- recovery, only when an operator asks for it -----------------------------------

    def backup_state(self) -> LedgerState:
        """What the backup (the previous generation) says; raises `LedgerCorrupt`."""
        self._check_state_dir(create=False)
        with files.host_refusals(self.backup, "read"):
            if not self.backup.exists() and not self.backup.is_symlink():
                raise LedgerCorrupt(self.backup, "there is no backup")
            return self._load_file(self.backup)

    def replace_corrupt(self, state: LedgerState) -> Path | None:
        """Move a corrupt ledger aside (never overwritten) and write `state` in its place.

        The written generation is higher than any the backup knew, so readers see
        a change.  Returns where the corrupt file went (None when there was none).
        Refuses when the ledger verifies: there is nothing to recover then.
        """
        self._check_state_dir(create=True)
        with self._locked():
            aside = None
            with files.host_refusals(self.path, "move aside"):
                self._remove_stray_temp_unlocked()
                if self.path.exists() or self.path.is_symlink():
                    try:
                        self._load_file(self.path)
                    except LedgerCorrupt:
                        pass
                    else:
                        raise LedgerCorrupt(self.path, "it verifies; there is nothing to recover")
                    stamp = time.strftime("%Y%m%dT%H%M%S")
                    aside = self.state_dir / f"{LEDGER}.corrupt-{stamp}-{os.getpid()}"
                    os.rename(self.path, aside)
                    files.fsync_dir(self.state_dir)
            self._write_unlocked(replace(state, generation=state.generation + 1))
            return aside

    def _write_unlocked(self, state: LedgerState) -> None:
        try:
            data = ledger_format.encode(state)
        except ledger_format.FormatError as error:
            raise LedgerWriteFailed(self.path, str(error)) from error
        try:
            files.replace_file(
                self.path,
                data,
                temp=self.state_dir / TEMP,
                before_replace=self._link_backup_unlocked,
                step=lambda name: crashpoint(f"ledger.{name}"),
            )
        except OSError as error:
            why, fix = files.describe_os_error(Path(error.filename or self.path), error)
            raise LedgerWriteFailed(self.path, why, fix) from error
        global _last
        self._decoded = (data, state)  # the next transaction reads what was just written
        _last = self._decoded
        self.generation_seen = state.generation
        self._write_cache_unlocked(state, ledger_format.checksum_of(data), len(data))

    def _write_cache_unlocked(self, state: LedgerState, digest: str, size: int) -> None:
        """The JSON copy readers may use instead of parsing the TOML; not durable and
        not needed: a missing, stale or damaged one is simply not used.  A ledger
        under CACHE_FROM bytes has none (one made for an earlier, larger generation
        is removed)."""
        cache, temp = self.state_dir / CACHE, self.state_dir / f"{CACHE}.tmp"
        try:
            if size < CACHE_FROM:
                cache.unlink(missing_ok=True)
                return
            temp.unlink(missing_ok=True)
            files.replace_file(
                cache, ledger_format.encode_cache(state, digest), temp=temp, durable=False
            )
        except OSError as error:
            log.warning("could not write %s: %s", cache, error)

    def _cache_bytes(self) -> bytes | None:
        cache = self.state_dir / CACHE
        try:
            files.check_existing(cache, single_link=True)
            return cache.read_bytes()
        except (OSError, StateDirUnsafe):
            return None

    def _link_backup_unlocked(self) -> None:
        """Make `.bak` the current generation without a moment where it is absent."""
        if not self.path.exists():
            return
        staging = self.state_dir / f"{BACKUP}.tmp"
        staging.unlink(missing_ok=True)
        os.link(self.path, staging)
        os.replace(staging, self.backup)

    def _remove_stray_temp_unlocked(self) -> None:
        for name in (TEMP, f"{BACKUP}.tmp", f"{CACHE}.tmp"):
            if files.remove_stray(self.state_dir / name):
                log.info("removed %s, left by an interrupted write", self.state_dir / name)

    def _load_file(self, path: Path) -> LedgerState:
        """The state in `path`, decoded once per content in this process: the bytes are
        read every time (cheap), the TOML parsed only when they differ from those
        decoded last (a claim reads the ledger in every one of its transactions)."""
        files.check_existing(path, single_link=False)
        try:
            data = path.read_bytes()
        except (PermissionError, FileNotFoundError):
            raise  # the host's refusal (host_refusals says it), not damage
        except OSError as error:
            raise LedgerCorrupt(path, f"cannot be read: {error}") from error
        global _last
        if self._decoded is not None and self._decoded[0] == data:
            state = self._decoded[1]
        elif _last is not None and _last[0] == data:
            state = _last[1]
            self._decoded = _last
        else:
            try:
                cached = path == self.path and len(data) >= CACHE_FROM
                state = ledger_format.decode(data, self._cache_bytes() if cached else None)
            except ledger_format.FormatError as error:
                raise LedgerCorrupt(path, str(error)) from error
            self._decoded = (data, state)
        _last = self._decoded
        if path == self.path:
            self.generation_seen = state.generation
        return state

    # -- locking -------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = files.open_checked(self.lock_path, os.O_RDWR | os.O_CREAT)
        try:
            if not files.lock_within(fd, self.lock_timeout):
                pid = _lock_holder(fd)
                raise LedgerBusy(self.lock_path, self.lock_timeout, pid, _user_of(pid))
            # The pid is advisory (who last took the lock), for the LedgerBusy message;
            # a full filesystem may refuse it, and that is no reason to fail.
            # Unbuffered: nothing is left to fail again when the handle is closed.
            # Written over the last one at a fixed width, not truncated first: a
            # truncation is a metadata change on every transaction (0.1-0.2 ms).
            with contextlib.suppress(OSError):
                os.pwrite(fd, _pid_note(os.getpid()), 0)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    # -- safety of the state directory ------------------------------------------------

    def _check_state_dir(self, create: bool) -> None:
        files.check_directory(self.state_dir, create=create)


def _pid_note(pid: int) -> bytes:
    """The lock file's text: the pid, padded to a width no pid exceeds (pid_max is at
    most 2**22), so that it always covers the one written before it."""
    return f"{pid:<10}\n".encode()


def _lock_holder(fd: int) -> int | None:
    """The process that holds the lock: the kernel's word (/proc/locks, by the lock
    file's device and inode), else the pid the last taker wrote into the file."""
    try:
        info = os.fstat(fd)
        wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a waiter has "->")
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    try:
        text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None


def _user_of(pid: int | None) -> str | None:
    """Who runs `pid`, when it is not this process's user (a lock held by another user)."""
    if pid is None:
        return None
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    if uid == os.geteuid():
        return None
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
