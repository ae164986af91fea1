"""The hidden verbs: processes a hook starts to finish its work after it returned.

`charly-arbiter _finish-release HANDOFF` (the rest of a release that brings holders
back) and `charly-arbiter _watch-start HANDOFF` (the Proxmox hook's watch of a start
that may fail after pre-start) are started by `hooksession.spawn`, never by a
person, so `--help` does not list them; their names show in `ps`.  Each takes one
argument, the hook's `Handoff` as JSON.  Exit codes follow the CLI's contract:
0 done (what did not come back stays in the ledger for `restore`, and the log says
so), 1 a step failed, 2 not one hand-off, or one that is not valid.  Their stdout
and stderr are /dev/null, so what goes wrong is logged too (the system log, and
`hook_log` once the configuration is read).
"""

from __future__ import annotations

import importlib
import logging

from charly_arbiter.errors import UsageError
from charly_arbiter.hookio import guarded
from charly_arbiter.hooksession import FINISH_RELEASE, WATCH_START, Handoff
from charly_arbiter.logsetup import log_setup

log = logging.getLogger("charly_arbiter.detached")

# verb -> the function that carries it out, given the hand-off (imported when run).
VERBS = {
    FINISH_RELEASE: "charly_arbiter.hooksession:finish_release",
    WATCH_START: "charly_arbiter.proxmox.hookrun:watch_start",
}


def main(argv: list[str]) -> int:
    """`argv` is the verb and its one argument."""
    verb = argv[0]
    if verb not in VERBS:
        return guarded(
            lambda: _refuse(f"no such command: {verb!r}"), what=verb, lets_go=lambda: False
        )
    log_setup(1, stderr=False)
    return guarded(lambda: _run(verb, argv[1:]), what=verb, lets_go=lambda: False)


def _refuse(why: str) -> int:
    raise UsageError(why, hint="this command is started by the hooks, not by hand")


def _run(verb: str, arguments: list[str]) -> int:
    if len(arguments) != 1:
        raise UsageError(
            f"usage: charly-arbiter {verb} HANDOFF (one argument: a hook's hand-off as JSON)",
            hint="this command is started by the hooks, not by hand",
        )
    handoff = Handoff.from_json(arguments[0])
    module, _, name = VERBS[verb].partition(":")
    target = getattr(importlib.import_module(module), name)
    try:
        code: int = target(handoff)
    except Exception as error:
        log.error("%s for %s failed: %s", verb, handoff.claimant, error)
        raise
    return code
