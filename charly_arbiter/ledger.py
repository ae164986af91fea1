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
import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import portalocker

from charly_arbiter import ledger_format
from charly_arbiter.crashpoints import crashpoint
from charly_arbiter.errors import LedgerBusy, LedgerCorrupt, LedgerWriteFailed, StateDirUnsafe
from charly_arbiter.model import LedgerState

log = logging.getLogger(__name__)

LEDGER = "ledger.toml"
BACKUP = "ledger.toml.bak"
LOCK = "ledger.lock"
TEMP = "ledger.toml.tmp"
_POLL = 0.02


@dataclass
class Transaction:
    """The state as read under the lock; assign `state` to have it written."""

    state: LedgerState
    recovered_from_backup: bool = False


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

    # -- reading ---------------------------------------------------------------

    def read(self) -> LedgerState:
        """The current state without taking the lock; raises `LedgerCorrupt`."""
        self._check_state_dir(create=False)
        # The backup is looked at first: a ledger exists before its first backup
        # does and never goes away, so a backup seen *before* a missing ledger
        # means damage, while one seen after may just come from the first writes running meanwhile.
        backup_existed = self.backup.exists()
        if self.path.exists() or self.path.is_symlink():
            return self._load_file(self.path)
        if backup_existed:
            raise LedgerCorrupt(self.path, f"it is missing but {self.backup} exists")
        return LedgerState()

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

        Keep the body short: never wait on the outside world inside it.
        """
        self._check_state_dir(create=True)
        with self._locked():
            txn = Transaction(*self._load_for_update_unlocked())
            before = txn.state
            yield txn
            if txn.state != before:
                self._write_unlocked(replace(txn.state, generation=before.generation + 1))

    def recover(self) -> LedgerState:
        """Take the lock once: remove what an interrupted write left behind and
        fall back to a verifying backup if the ledger is corrupt (`restore` runs
        this first, so it converges even when no lease needs it)."""
        with self.transaction() as txn:
            return txn.state

    def _load_for_update_unlocked(self) -> tuple[LedgerState, bool]:
        self._remove_stray_temp_unlocked()
        if not self.path.exists() and not self.path.is_symlink():
            if self.backup.exists():
                # A ledger never disappears on its own; its backup says it existed.
                raise LedgerCorrupt(self.path, f"it is missing but {self.backup} exists")
            return LedgerState(), False
        try:
            return self._load_file(self.path), False
        except LedgerCorrupt as error:
            return self._fall_back_to_backup_unlocked(error), True

    def _fall_back_to_backup_unlocked(self, error: LedgerCorrupt) -> LedgerState:
        """Use `.bak` only when it verifies, and never overwrite the corrupt file."""
        try:
            state = self._load_file(self.backup)
        except (LedgerCorrupt, FileNotFoundError):
            raise LedgerCorrupt(
                self.path,
                f"{error.why}, and {self.backup} does not verify either",
                hint=(
                    f"move {self.path} aside, check which GPUs are on vfio-pci and which "
                    "holders are stopped, then start again with an empty ledger"
                ),
            ) from None
        aside = self.state_dir / f"{LEDGER}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        os.rename(self.path, aside)
        _fsync_dir(self.state_dir)
        # The backup becomes the ledger at once, whatever the caller does next
        # (a refusal writes nothing): a missing ledger would be corrupt too.
        self._write_unlocked(state)
        log.warning(
            "%s is corrupt (%s); moved it to %s and continued from %s (generation %d)",
            self.path,
            error.why,
            aside,
            self.backup,
            state.generation,
        )
        return state

    def _write_unlocked(self, state: LedgerState) -> None:
        try:
            data = ledger_format.encode(state)
        except ledger_format.FormatError as error:
            raise LedgerWriteFailed(self.path, str(error)) from error
        temp = self.state_dir / TEMP
        crashpoint("ledger.open_temp")
        try:
            fd = os.open(
                temp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
        except OSError as error:
            raise LedgerWriteFailed(self.path, f"cannot create {temp}: {error}") from error
        try:
            half = len(data) // 2
            _write_all(fd, data[:half])
            crashpoint("ledger.write_half")
            _write_all(fd, data[half:])
            crashpoint("ledger.write_all")
            os.fsync(fd)  # an fsync error is fatal for this write: no retry, no rename
            crashpoint("ledger.fsync_temp")
        except OSError as error:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise LedgerWriteFailed(self.path, f"writing {temp} failed: {error}") from error
        os.close(fd)
        try:
            if self.path.exists():
                self._link_backup_unlocked()
            crashpoint("ledger.backup")
            os.replace(temp, self.path)
            crashpoint("ledger.rename")
            _fsync_dir(self.state_dir)
            crashpoint("ledger.fsync_dir")
        except OSError as error:
            temp.unlink(missing_ok=True)
            raise LedgerWriteFailed(self.path, str(error)) from error

    def _link_backup_unlocked(self) -> None:
        """Make `.bak` the current generation without a moment where it is absent."""
        staging = self.state_dir / f"{BACKUP}.tmp"
        staging.unlink(missing_ok=True)
        os.link(self.path, staging)
        os.replace(staging, self.backup)

    def _remove_stray_temp_unlocked(self) -> None:
        for name in (TEMP, f"{BACKUP}.tmp"):
            stray = self.state_dir / name
            if stray.exists() or stray.is_symlink():
                log.info("removing %s left by an interrupted write", stray)
                stray.unlink()

    def _load_file(self, path: Path) -> LedgerState:
        self._check_file(path)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise LedgerCorrupt(path, f"cannot be read: {error}") from error
        try:
            return ledger_format.decode(data)
        except ledger_format.FormatError as error:
            raise LedgerCorrupt(path, str(error)) from error

    # -- locking -------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        handle = os.fdopen(fd, "r+")
        try:
            self._check_file(self.lock_path)
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    portalocker.lock(handle, portalocker.LOCK_EX | portalocker.LOCK_NB)
                    break
                except portalocker.exceptions.LockException:
                    if time.monotonic() >= deadline:
                        raise LedgerBusy(
                            self.lock_path, self.lock_timeout, _lock_holder(handle)
                        ) from None
                    time.sleep(_POLL)
            # The pid is advisory (who last took the lock), for the LedgerBusy message.
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            yield
        finally:
            handle.close()  # closing the descriptor releases the flock

    # -- safety of the state directory ------------------------------------------------

    def _check_state_dir(self, create: bool) -> None:
        directory = self.state_dir
        if create and not directory.exists() and not directory.is_symlink():
            directory.mkdir(mode=0o700, parents=True)
        try:
            info = os.lstat(directory)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(info.st_mode):
            raise StateDirUnsafe(directory, "it is a symlink")
        if not stat.S_ISDIR(info.st_mode):
            raise StateDirUnsafe(directory, "it is not a directory")
        _check_owner_and_mode(directory, info)

    def _check_file(self, path: Path) -> None:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(info.st_mode):
            raise StateDirUnsafe(path, "it is a symlink")
        if not stat.S_ISREG(info.st_mode):
            raise StateDirUnsafe(path, "it is not a regular file")
        _check_owner_and_mode(path, info)


def _check_owner_and_mode(path: Path, info: os.stat_result) -> None:
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateDirUnsafe(path, f"it is group- or world-writable (mode {info.st_mode:o})")
    if os.geteuid() == 0 and info.st_uid != 0:
        raise StateDirUnsafe(path, f"it is owned by uid {info.st_uid}, not root")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno != errno.EINVAL:  # some filesystems cannot fsync a directory
            raise
    finally:
        os.close(fd)


def _lock_holder(handle: object) -> int | None:
    """The pid written by the process that holds the lock, where it is readable."""
    try:
        handle.seek(0)  # type: ignore[attr-defined]
        text = handle.read(32).strip()  # type: ignore[attr-defined]
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None
