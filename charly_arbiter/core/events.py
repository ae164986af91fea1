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
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from charly_arbiter.core.model import HOME, target_label

log = logging.getLogger("charly_arbiter.core.events")

Sink = Callable[[str, dict[str, Any]], None]


class EventKind(StrEnum):
    """Every kind of event.  The values are what the history file, the journal
    (CHARLY_EVENT), metrics, alert rules and the Cockpit page read: never change one."""

    CLAIM = "claim"
    REFUSED = "refused"
    STOPPING = "stopping"
    PREEMPTED = "preempted"
    SWITCHING = "switching"
    SWITCHED = "switched"
    ACTIVE = "active"
    POISONED = "poisoned"
    RELEASE = "release"
    FAILED = "failed"
    RESTORE = "restore"
    STARTING = "starting"
    RESTORED = "restored"
    RESTORE_FAILED = "restore-failed"
    POISON_CLEARED = "poison-cleared"
    MISMATCH = "mismatch"
    ADOPTED = "adopted"
    SEND_HOME = "send-home"
    RECOVERED = "recovered"
    MIG = "mig"
    MIG_DONE = "mig-done"
    VF_COUNT = "vf-count"
    VF_COUNTED = "vf-counted"
    TOLD = "told"
    SESSION_ENDED = "session-ended"
    SLEEP_BLOCKED = "sleep-blocked"
    SLEEP_ALLOWED = "sleep-allowed"
    SLEEP_LOCK_FAILED = "sleep-lock-failed"


# Events that begin a step which may take long (a VM shutting down, a bind);
# each is followed by a completion from the same process unless it died there.
STEP_STARTS = frozenset({EventKind.STOPPING, EventKind.SWITCHING, EventKind.STARTING})
# Events an operator should notice (journal priority warning or error).
WARNINGS = frozenset(
    {EventKind.REFUSED, EventKind.FAILED, EventKind.RESTORE_FAILED, EventKind.SLEEP_LOCK_FAILED}
)
ERRORS = frozenset({EventKind.POISONED})


class Events:
    def __init__(self, sinks: list[Sink] | None = None) -> None:
        self.sinks: list[Sink] = list(sinks or [])
        # Fields every event carries, asked for at each emit (the ledger generation
        # the process saw last); a provider's None leaves its field out.
        self.context: dict[str, Callable[[], Any]] = {}

    def emit(self, kind: EventKind, **fields: Any) -> None:
        """Record one event; a failing sink is logged (one line; the traceback only
        at debug level) and never stops the caller."""
        for key, provide in self.context.items():
            if key not in fields and (value := provide()) is not None:
                fields[key] = value
        if log.isEnabledFor(logging.INFO):  # (logfmt costs more than a claim's decision)
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
        EventKind.CLAIM: lambda: f"{claimant} claims {token} ({get('mode', '?')})",
        EventKind.REFUSED: lambda: f"{claimant} was refused {token}: {why}",
        EventKind.STOPPING: lambda: f"{claimant}: stopping {holder} ({get('how', 'stop')})",
        EventKind.PREEMPTED: lambda: f"{claimant}: stopped {holder} ({get('how', 'stop')})",
        EventKind.SWITCHING: lambda: (
            f"{claimant}: switching {token} {_towards(get('driver', '?'))}"
        ),
        EventKind.SWITCHED: lambda: (
            f"{token} is {_now_on(get('driver', '?'))} for {claimant} "
            f"(took {get('seconds', '?')} s)"
        ),
        EventKind.ACTIVE: lambda: f"{claimant} holds {token} ({get('mode', '?')})",
        EventKind.POISONED: lambda: (
            f"{token} is poisoned ({claimant}'s "
            + ("operation" if claimant.startswith("arbiter:") else "switch")
            + f" failed): {why}"
        ),
        EventKind.MIG: lambda: (
            f"{token}: changing its MIG {get('change', '?')}, its holders stopped"
        ),
        EventKind.MIG_DONE: lambda: f"{token}: MIG {get('change', '?')} done, its holders back",
        EventKind.VF_COUNT: lambda: (
            f"{token}: changing its VF count from {get('before', '?')} to {get('count', '?')}"
        ),
        EventKind.VF_COUNTED: lambda: (
            f"{token} has {get('count', '?')} VFs now (took {get('seconds', '?')} s)"
        ),
        EventKind.SLEEP_BLOCKED: lambda: (
            f"sleep is blocked while {_joined(token)} {_is_are(token)} passed through to {claimant}"
        ),
        EventKind.SLEEP_ALLOWED: lambda: (
            f"sleep is allowed again: {_joined(token)} {_is_are(token)} no longer passed "
            "through" + (f" to {claimant}" if get("claimant") else "")
        ),
        EventKind.SLEEP_LOCK_FAILED: lambda: (
            f"{claimant}: sleep could not be blocked for {_joined(token)}: {why}"
        ),
        EventKind.RELEASE: lambda: f"{claimant} releases its lease",
        EventKind.FAILED: lambda: f"{claimant}'s claim failed and is undone: {why}",
        EventKind.RESTORE: lambda: f"restoring {claimant}",
        EventKind.STARTING: lambda: f"{claimant}: starting {holder} again",
        EventKind.RESTORED: lambda: f"{claimant}: {holder} runs again",
        EventKind.RESTORE_FAILED: lambda: f"{claimant}: could not start {holder} again: {why}",
        EventKind.TOLD: lambda: (
            f"{claimant}: told {holder} why it ends, {get('seconds', '?')} s before it does"
        ),
        EventKind.SESSION_ENDED: lambda: (
            f"{claimant}: {holder} is not started again (a session cannot be); "
            "the display manager's login screen takes its place"
        ),
        EventKind.POISON_CLEARED: lambda: f"the poison of {token} was cleared",
        EventKind.MISMATCH: lambda: (
            (f"{get('token')}: " if get("token") else "") + get("found", "?")
        ),
        EventKind.ADOPTED: lambda: (
            f"{token} was adopted as bound to vfio-pci on purpose, by the administrator"
            if get("by") == "administrator"
            else f"{token} was adopted as held by {claimant} (exclusive)"
            + (f", which had stopped {get('stopped')}" if get("stopped") else "")
        ),
        EventKind.SEND_HOME: lambda: f"{claimant}: sending {token} home, as an operator decided",
        EventKind.RECOVERED: lambda: (
            f"the ledger was recovered from {get('source', '?')}"
            + (f" (generation {get('generation')})" if get("generation") else "")
            + f": {why}"
        ),
    }
    sentence = sentences.get(kind)
    if sentence is not None:
        return sentence()
    return f"{kind} {logfmt(fields)}"


def _joined(tokens: str) -> str:
    """An event's comma-joined tokens in words: "gpu0", "gpu0 and gpu1"."""
    return and_list([token for token in tokens.split(",") if token])


def _is_are(tokens: str) -> str:
    return "are" if "," in tokens else "is"


def drivers_label(targets: Mapping[str, str | None]) -> str:
    """The target drivers of a switch as events record them: names joined by commas,
    "home" for the kernel's choice (described as words by `describe`)."""
    return ",".join(sorted({target_label(driver or "") for driver in targets.values()}))


def _towards(label: str) -> str:
    """ "to vfio-pci", "to nvidia and snd_hda_intel", "home" (the kernel picks the driver)."""
    names = [name for name in label.split(",") if name and name != HOME]
    if HOME not in label.split(","):
        return f"to {and_list(names)}"
    return "home" + (f" (to {and_list(names)} and the kernel's choice)" if names else "")


def _now_on(label: str) -> str:
    names = [name for name in label.split(",") if name and name != HOME]
    if HOME in label.split(","):
        return "home" + (f" (on {and_list(names)} and the kernel's choice)" if names else "")
    return f"now on {and_list(names)}"


def and_list(names: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    names = list(names)
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} and {names[-1]}"


def count_of(number: int, noun: str, plural: str | None = None) -> str:
    """ "1 lease", "2 leases", "0 leases"."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def a_or_an(word: str) -> str:
    """ "an exclusive", "a shared"."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
