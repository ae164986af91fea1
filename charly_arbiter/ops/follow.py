"""`status --follow`: a new status document whenever something changed, for a reader
that stays open (Cockpit's GPUs page, a script).

Running `status --json` again and again costs an interpreter each time and is
either late or wasteful.  Following costs one sleeping process that looks at
two files' `stat` every second: the ledger (every write replaces the file and
raises its generation) and the history (a refusal writes no ledger, but the
page's timeline shows it).  The full status, which asks the host whether each
claimant still runs, is taken only when one of them changed, or every
`interval` seconds: a claimant that dies strands its lease without any write.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

Signature = tuple[tuple[int, int, int] | None, ...]


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


def follow(
    produce: Callable[[], str],
    watched: Sequence[Path],
    emit: Callable[[str], bool],
    *,
    interval: float,
    reader_gone: Callable[[], bool] = lambda: False,
    tick: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Emit `produce()` now, then again whenever a watched file changed (even when
    the document is the same: the history may be what changed) or the document
    differs at the periodic check.  Returns when `emit` says the reader is gone,
    or `reader_gone()` does between changes."""
    seen = signature(watched)
    text = produce()
    if not emit(text):
        return
    checked = clock()
    while True:
        sleep(tick)
        if reader_gone():
            return
        now_seen = signature(watched)
        files_changed = now_seen != seen
        if not files_changed and clock() - checked < interval:
            continue
        new_text = produce()
        checked = clock()
        if (files_changed or new_text != text) and not emit(new_text):
            return
        seen, text = now_seen, new_text
