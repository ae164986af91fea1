"""The processes the hooks hand work to (hooksession.DETACHED: `_finish-release`,
`_watch-start`), found by what they were handed: their one argument is the hook's
`Handoff` as JSON, so a test knows the ones of its own state directory."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Collection
from pathlib import Path

from charly_arbiter.errors import UsageError
from charly_arbiter.hooksession import DETACHED, Handoff


def detached_pids(state_dir: Path, verbs: Collection[str] = DETACHED) -> list[int]:
    """The live processes of `verbs` handed work on `state_dir`."""
    found = []
    wanted = {verb.encode() for verb in verbs}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            for word, argument in itertools.pairwise(argv):
                if word in wanted and _handed(argument, state_dir):
                    found.append(int(entry.name))
    return found


def _handed(argument: bytes, state_dir: Path) -> bool:
    try:
        handoff = Handoff.from_json(argument.decode())
    except (UsageError, UnicodeDecodeError):
        return False
    return Path(handoff.state_dir) == state_dir.absolute()


def wait_for_handoffs(state_dir: Path, timeout: float = 60.0) -> None:
    """Until every process a hook handed work on `state_dir` has ended (the event a
    test waits for after a hook's stop, instead of a pause long enough to hope)."""
    deadline = time.monotonic() + timeout
    while pids := detached_pids(state_dir):
        if time.monotonic() > deadline:
            raise AssertionError(f"still at work after {timeout:g} s: pids {pids}")
        time.sleep(0.05)
