"""`status --follow`: a new status document whenever something changed, for a reader
that stays open (Cockpit's GPUs page, a script).

Running `status --json` again and again costs an interpreter each time and is
either late or wasteful.  Following costs one sleeping process that wakes when
the kernel says one of two files changed (inotify on their directory): the
ledger (every write replaces the file and raises its generation) and the
history (a refusal writes no ledger, but the page's timeline shows it).  A
change is on its way to the reader a few milliseconds after the write; where
inotify cannot be had (another kernel, the watch limit reached, the directory
missing) the follower looks at the files' `stat` once a second instead.  The
full status, which asks the host whether each claimant still runs, is taken
only when one of them changed, or every `interval` seconds: a claimant that
dies strands its lease without any write.

The same wait watches the reader: when it closes the pipe (the page went
away), poll says so and the follower exits at once, between changes too.
"""

from __future__ import annotations

import os
import select
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

Signature = tuple[tuple[int, int, int] | None, ...]

# <sys/inotify.h>: what changes a file's content or which file a name is.
IN_MODIFY = 0x002
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000  # the watch is gone (its directory was removed or moved)
WATCH_MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
SETTLE = 0.02  # seconds without an event that end a burst of writes
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


def signature(paths: Sequence[Path]) -> Signature:
    """Inode, size and modification time of each file (None while it is missing)."""
    found: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            found.append(None)
            continue
        found.append((info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(found)


class Wakeup(Protocol):
    def wait(self, timeout: float) -> bool:
        """Block until a watched file may have changed or `timeout` seconds passed;
        True when the reader is gone."""

    def close(self) -> None: ...


def follow(
    produce: Callable[[], str],
    watched: Sequence[Path],
    emit: Callable[[str], bool],
    *,
    interval: float,
    wakeup: Callable[[], Wakeup],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Emit `produce()` now, then again whenever a watched file changed (even when
    the document is the same: the history may be what changed) or the document
    differs at the periodic check.  Returns when `emit` says the reader is gone,
    or the wait does between changes.

    `wakeup` is made after the first document is out (what it imports and sets
    up is not on the reader's first wait); a change in between is caught by the
    signature, taken before the first document and compared before every wait."""
    seen = signature(watched)
    text = produce()
    if not emit(text):
        return
    checked = clock()
    waiting = wakeup()
    try:
        while True:
            now_seen = signature(watched)
            files_changed = now_seen != seen
            if files_changed or clock() - checked >= interval:
                new_text = produce()
                checked = clock()
                if (files_changed or new_text != text) and not emit(new_text):
                    return
                seen, text = now_seen, new_text
                continue  # look once more: a write may have come during produce()
            if waiting.wait(max(0.0, checked + interval - clock())):
                return
    finally:
        waiting.close()


class FileWakeup:
    """Wakes on an inotify event naming one of the watched files, or polls their
    `stat` every `tick` seconds while inotify cannot be had (tried again at every
    tick: a state directory made later, or removed and made again, is watched
    from then on); watches `reader` (a file descriptor, usually stdout) for its
    other end being closed."""

    def __init__(self, watched: Iterable[Path], reader: int | None, tick: float = 1.0) -> None:
        self.tick = tick
        self.reader = reader
        paths = list(watched)
        self.names = {path.name.encode() for path in paths}
        self.directories = sorted({path.parent for path in paths})
        self.inotify = _inotify(self.directories)

    @property
    def polling(self) -> bool:
        """Whether this falls back to looking every `tick` seconds."""
        return self.inotify is None

    def wait(self, timeout: float) -> bool:
        if self.inotify is None:
            self.inotify = _inotify(self.directories)
        poller = select.poll()
        if self.reader is not None:
            poller.register(self.reader, 0)  # POLLERR and POLLHUP are always reported
        if self.inotify is not None:
            poller.register(self.inotify, select.POLLIN)
        else:
            timeout = min(timeout, self.tick)
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            ready = dict(poller.poll(left * 1000))
            if self.reader is not None and ready.get(self.reader, 0) & (
                select.POLLERR | select.POLLHUP | select.POLLNVAL
            ):
                return True
            if self.inotify is not None and ready.get(self.inotify):
                if self._changed():  # (or the watch went away: polling from now on)
                    self._settle()
                    return False
                continue
            return False

    def _settle(self) -> None:
        """A claim writes the ledger and appends to the history within milliseconds:
        take the burst as one change (one look, one line) by waiting until no event
        came for `SETTLE` seconds (at most ten times that)."""
        for _ in range(10):
            if self.inotify is None or not select.select([self.inotify], [], [], SETTLE)[0]:
                return
            self._changed()

    def _changed(self) -> bool:
        """Drain the queued events; whether one names a watched file (or was lost)."""
        assert self.inotify is not None
        changed = False
        while True:
            try:
                data = os.read(self.inotify, 64 * 1024)
            except BlockingIOError:
                return changed
            offset = 0
            while offset + EVENT.size <= len(data):
                _, mask, _, length = EVENT.unpack_from(data, offset)
                name = data[offset + EVENT.size : offset + EVENT.size + length].rstrip(b"\0")
                offset += EVENT.size + length
                if mask & IN_IGNORED:
                    self.close()
                    return True
                if mask & IN_Q_OVERFLOW or name in self.names:
                    changed = True

    def close(self) -> None:
        if self.inotify is not None:
            os.close(self.inotify)
            self.inotify = None


def _inotify(directories: Iterable[Path]) -> int | None:
    """A non-blocking inotify descriptor watching `directories`, or None where the
    kernel or the C library offers none, or a watch cannot be added."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        init, add = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):
        return None
    descriptor = int(init(os.O_NONBLOCK | os.O_CLOEXEC))
    if descriptor < 0:
        return None
    for directory in directories:
        if int(add(descriptor, os.fsencode(directory), WATCH_MASK)) < 0:
            os.close(descriptor)
            return None
    return descriptor
