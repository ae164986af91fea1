"""Named places where a test may kill the process, to prove crash safety.

`CHARLY_ARBITER_CRASH_AT=STEP` (or `STEP#N` for the N-th time that step is
reached) makes the process SIGKILL itself there: a real `kill -9`, not an
exception, so nothing gets to clean up.  In-process tests can set `hook`
instead.  Outside tests the variable is unset and a crash point costs one
comparison.  The variable is read at the first crash point, not at import: a child
of the resident helper (`serve`) imported this module before it had its client's
environment.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable

hook: Callable[[str], None] | None = None
_UNREAD = "\0"
_target: str | None = _UNREAD
_seen: Counter[str] = Counter()


def crashpoint(step: str) -> None:
    global _target
    if hook is not None:
        hook(step)
    if _target is None:
        return
    if _target is _UNREAD:
        _target = os.environ.get("CHARLY_ARBITER_CRASH_AT")
        if _target is None:
            return
    _seen[step] += 1
    name, _, nth = _target.partition("#")
    if name == step and (not nth or int(nth) == _seen[step]):
        os.kill(os.getpid(), signal.SIGKILL)
