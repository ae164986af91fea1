"""Named places where a test may kill the process, to prove crash safety.

`CHARLY_ARBITER_CRASH_AT=STEP` (or `STEP#N` for the N-th time that step is
reached) makes the process SIGKILL itself there: a real `kill -9`, not an
exception, so nothing gets to clean up.  In-process tests can set `hook`
instead.  Outside tests the variable is unset and a crash point costs one
comparison.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable

hook: Callable[[str], None] | None = None
_target = os.environ.get("CHARLY_ARBITER_CRASH_AT")
_seen: Counter[str] = Counter()


def crashpoint(step: str) -> None:
    if hook is not None:
        hook(step)
    if _target is None:
        return
    _seen[step] += 1
    name, _, nth = _target.partition("#")
    if name == step and (not nth or int(nth) == _seen[step]):
        os.kill(os.getpid(), signal.SIGKILL)
