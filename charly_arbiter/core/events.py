"""What happened, said once: every claim, refusal, preemption, switch, restore,
poisoning and clear goes through `Events.emit`.

The arbiter only emits; where events go (the log, the history file, the
journal, a terminal's progress line) is decided in `eventlog`, so adding a
destination touches no rule.  `describe` is the one sentence for each kind of
event, shared by the history, the journal and the progress lines so that an
operator reads the same words everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from charly_arbiter.core.model import target_label

log = logging.getLogger("charly_arbiter.core.events")

Sink = Callable[[str, dict[str, Any]], None]

# Events that begin a step which may take long (a VM shutting down, a bind);
# each is followed by a completion from the same process unless it died there.
STEP_STARTS = frozenset({"stopping", "switching", "starting"})
# Events an operator should notice (journal priority warning or error).
WARNINGS = frozenset({"refused", "failed", "restore-failed"})
ERRORS = frozenset({"poisoned"})


class Events:
    def __init__(self, sinks: list[Sink] | None = None) -> None:
        self.sinks: list[Sink] = list(sinks or [])

    def emit(self, kind: str, **fields: Any) -> None:
        """Record one event; a failing sink is logged (one line; the traceback only
        at debug level) and never stops the caller."""
        log.info("%s %s", kind, logfmt(fields))
        for sink in self.sinks:
            try:
                sink(kind, fields)
            except Exception as error:
                log.warning("could not record event %s: %s", kind, error)
                log.debug("the failing sink", exc_info=True)


def logfmt(fields: Mapping[str, Any]) -> str:
    """`key=value` pairs, quoted where a value has spaces, quotes, `=` or control
    characters, so that a guest name like `my vm` cannot make a line ambiguous."""
    return " ".join(f"{key}={_quoted(str(value))}" for key, value in fields.items())


def _quoted(text: str) -> str:
    if text and not any(c in text for c in ' "=\\') and text.isprintable():
        return text
    escaped = text.encode("unicode_escape").decode("ascii").replace('"', '\\"')
    return f'"{escaped}"'


def describe(kind: str, fields: Mapping[str, Any]) -> str:
    """One plain sentence for an event, e.g. "libvirt:win11 claims gpu0 (exclusive)"."""
    get = {key: str(value) for key, value in fields.items()}.get
    claimant = get("claimant", "?")
    token = get("token", "?")
    holder = get("holder", "?")
    why = get("why", "")
    sentences: dict[str, Callable[[], str]] = {
        "claim": lambda: f"{claimant} claims {token} ({get('mode', '?')})",
        "refused": lambda: f"{claimant} was refused {token}: {why}",
        "stopping": lambda: f"{claimant}: stopping {holder} ({get('how', 'stop')})",
        "preempted": lambda: f"{claimant}: stopped {holder} ({get('how', 'stop')})",
        "switching": lambda: f"{claimant}: switching {token} to {get('driver', '?')}",
        "switched": lambda: (
            f"{token} is now on {get('driver', '?')} for {claimant} (took {get('seconds', '?')} s)"
        ),
        "active": lambda: f"{claimant} holds {token} ({get('mode', '?')})",
        "poisoned": lambda: f"{token} is poisoned ({claimant}'s switch failed): {why}",
        "release": lambda: f"{claimant} releases its lease",
        "failed": lambda: f"{claimant}'s claim failed and is undone: {why}",
        "restore": lambda: f"restoring {claimant}",
        "starting": lambda: f"{claimant}: starting {holder} again",
        "restored": lambda: f"{claimant}: {holder} runs again",
        "restore-failed": lambda: f"{claimant}: could not start {holder} again: {why}",
        "poison-cleared": lambda: f"the poison of {token} was cleared",
    }
    sentence = sentences.get(kind)
    if sentence is not None:
        return sentence()
    return f"{kind} {logfmt(fields)}"


def drivers_label(targets: Mapping[str, str]) -> str:
    """The target drivers of a switch as events name them ("home" for the kernel's choice)."""
    return ",".join(sorted({target_label(driver) for driver in targets.values()}))
