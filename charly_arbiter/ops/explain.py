"""`explain`: the state of one token or claimant, in sentences an operator acts on.

It combines three sources that each know part of the story: the ledger (who
holds what, what was stopped, which steps of an interrupted claim are still
planned), the host (drivers, what runs) as summarised by `Arbiter.status`,
and the history (why the last claim was refused or failed, which step a
killed process was in).  Every problem it names comes with the command that
fixes it.  Pure: the CLI gathers the facts, this only words them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from charly_arbiter.core.arbiter import Status, TokenStatus, rollback_found
from charly_arbiter.core.events import EventKind, and_list, describe
from charly_arbiter.core.host import Holder, ScreenUse
from charly_arbiter.core.model import (
    HolderKind,
    Lease,
    LeaseState,
    Mode,
    ScreenPolicy,
    StepState,
    as_time,
    human_time,
)
from charly_arbiter.core.planner import unaccounted_hint
from charly_arbiter.errors import cli_command
from charly_arbiter.ops.history import Record, last_holder


@dataclass(frozen=True)
class Facts:
    status: Status
    boot_id: str
    history: Sequence[Record]
    interrupted: frozenset[int]  # indexes into `history` (see history.interrupted)
    now: datetime
    # Who uses each token's screen now, with the token's `screen` policy.
    screens: Mapping[str, tuple[ScreenUse, ScreenPolicy]] = field(default_factory=dict)


def explain_token(name: str, facts: Facts) -> list[str]:
    token = next(t for t in facts.status.tokens if t.name == name)
    holding = [lease for lease in facts.status.leases if lease.claimant in token.claimants]
    label = f"{token.name} ({token.address})"
    sentences = _went_back(facts)
    if facts.status.corrupt:
        sentences.append(
            f"Who holds {label} is unknown: the ledger is corrupt. "
            f"Fix: run {cli_command('recover')}."
        )
    elif token.unaccounted:
        sentences += _unaccounted(token, facts)
    elif not holding and (
        kept := [
            lease
            for lease in facts.status.leases
            if name in lease.tokens
            and lease.claimant in facts.status.stranded
            and _screen_not_back(lease)
        ]
    ):
        # Kept because its display manager did not come back: the token is home and no
        # lease holds it, yet it is this token's desktop that is missing (finding F2).
        sentences.append(f"{label} is home, but the desktop it drove is not back.")
        for lease in kept:
            sentences += _screen_story(lease, facts)
    elif not holding:
        sentences.append(_unleased(label, token.users))
    elif token.mode == Mode.EXCLUSIVE:
        lease = holding[0]
        sentences.append(
            f"{label} is held exclusively by {lease.claimant} since {_when(lease.created, facts)}."
        )
    else:
        who = _and([f"{lease.claimant} since {_when(lease.created, facts)}" for lease in holding])
        sentences.append(f"{label} is shared by {who}.")
        sentences += [f"It is also {_use(holder)}." for holder in token.users]
    sentences.append(_drivers(token))
    sentences += _screen(name, facts)
    if token.bound_by_admin:
        sentences.append(
            "Its home is vfio-pci: the administrator keeps it there on purpose (`adopt "
            "--admin`), so it is only ever passed through; "
            f"{cli_command('send-home', operands=[token.name])} undoes that."
        )
    for lease in holding:
        sentences += _lease_story(lease, facts)
    sentences += _poison(token, facts)
    on_token = [(i, r) for i, r in enumerate(facts.history) if name in r.tokens]
    sentences += _last_trouble(on_token, facts, f"on {name}")
    sentences += _interrupted(
        {r.claimant for r in facts.status.leases if name in r.tokens}, facts, only_token=name
    )
    return sentences


def _screen(name: str, facts: Facts) -> list[str]:
    """Who uses its screen, and what an exclusive claim does about it."""
    if name not in facts.screens:
        return []
    use, policy = facts.screens[name]
    if not use.drives_screen:
        return []
    sentences = [f"{use.describe()}."]
    if not use.processes:
        return sentences
    if policy is ScreenPolicy.RELEASE:
        sentences.append(
            'With screen = "release", an exclusive claim stops them first, and the display '
            "manager is started again when the GPU comes back (a login screen, not the session)."
        )
    else:
        sentences.append(
            "An exclusive claim on it is refused while they use it. Fix: end the session "
            f'first, or set screen = "release" for {name} in arbiter.toml to let the arbiter '
            "stop them and start the display manager again afterwards."
        )
    return sentences


def _went_back(facts: Facts) -> list[str]:
    recorded = facts.status.history_generation
    if recorded is None:
        return []
    return [
        f"The ledger went backwards: {rollback_found(facts.status.generation, recorded)}, so "
        f"it may not know everything below. Fix: run {cli_command('recover')}."
    ]


def _unleased(label: str, users: Sequence[Holder]) -> str:
    """A token no lease holds: idle, or used by holders that hold no lease."""
    if not users:
        return f"{label} is idle: no lease holds it and nothing runs on it."
    if any(not holder.preemptible for holder in users):
        return (
            f"{label} is in use, though no lease holds it: it is {_use_list(users)}; "
            "exclusive claims on it are refused while that runs, shared claims use it beside it."
        )
    return f"{label} is idle: no lease holds it, but it is {_use_list(users)}."


def _use_list(users: Sequence[Holder]) -> str:
    return and_list([_use(holder) for holder in users])


def _use(holder: Holder) -> str:
    if not holder.preemptible:
        return f"used by {holder.ref}, which is not preemptible"
    if holder.passthrough:
        return f"passed through to {holder.ref}, which a claim stops"
    return f"used by {holder.ref}, which an exclusive claim stops"


def _unaccounted(token: TokenStatus, facts: Facts) -> list[str]:
    """A token on vfio-pci that the ledger does not account for, what the history
    says held it, and what the operator can decide."""
    label = f"{token.name} ({token.address})"
    sentences = [
        f"{label} is on vfio-pci ({', '.join(token.unaccounted)}), and no lease or poison in "
        "the ledger accounts for it: a lease was lost with the ledger, or something outside "
        "the arbiter bound it there. Nothing claims, releases or restores it until you decide."
    ]
    story = last_holder(facts.history, token.name)
    if story is None:
        sentences.append(
            "The history names nobody who holds it. Fix: " + unaccounted_hint(token.name) + "."
        )
        return sentences
    stopped = (
        f"; its claim had stopped {_and(list(story.stopped))}, which "
        f"{'is' if len(story.stopped) == 1 else 'are'} to be started again when it ends"
        if story.stopped
        else ""
    )
    sentences.append(
        f"The history says {story.claimant} claimed it exclusively at "
        f"{_when(story.since, facts)} and never released it{stopped}."
    )
    sentences.append(
        f"Fix: if {story.claimant} still uses it, run "
        f"{cli_command('adopt', operands=[token.name, story.claimant])}; "
        f"if nothing should have it, run {cli_command('send-home', operands=[token.name])}; "
        "if it is on vfio-pci on purpose, run "
        f"{cli_command('adopt', '--admin', operands=[token.name])}."
    )
    return sentences


def explain_claimant(claimant: str, facts: Facts) -> list[str]:
    sentences: list[str] = _went_back(facts)
    lease = next((x for x in facts.status.leases if x.claimant == claimant), None)
    if lease is None:
        sentences.append(f"{claimant} holds no lease.")
    else:
        tokens = ", ".join(lease.tokens)
        sentences.append(
            f"{claimant} holds {tokens} ({lease.mode}) since {_when(lease.created, facts)}; "
            f"the lease is {lease.state}."
        )
        for token in facts.status.tokens:
            if token.name in lease.tokens:
                sentences.append(_drivers(token))
        sentences += _lease_story(lease, facts, subject="it")
    for other in facts.status.leases:
        for record in other.stopped:
            if record.holder == claimant and not record.restored:
                done = "was stopped" if record.state is StepState.DONE else "is to be stopped"
                when = (
                    f"{other.claimant} releases {'it' if len(other.tokens) == 1 else 'them'}"
                    if other.mode is Mode.EXCLUSIVE
                    else f"the last shared lease on {', '.join(other.tokens)} ends"
                )
                sentences.append(
                    f"{claimant} {done} to make room for {other.claimant} on "
                    f"{', '.join(other.tokens)}; it will be started again when {when}."
                )
    about = [
        (i, r)
        for i, r in enumerate(facts.history)
        if claimant in (r.get("claimant"), r.get("holder"))
    ]
    sentences += _last_trouble(about, facts, f"by {claimant}", claimant=claimant)
    sentences += _interrupted({claimant}, facts)
    if lease is None and not about and len(sentences) == 1 + len(_went_back(facts)):
        sentences.append("Nothing about it is in the history either.")
    return sentences


def _drivers(token: TokenStatus) -> str:
    drivers = ", ".join(
        f"{address} on {driver or 'no driver'}" for address, driver in token.drivers
    )
    return f"Its functions: {drivers}."


def _lease_story(lease: Lease, facts: Facts, subject: str | None = None) -> list[str]:
    who = subject or lease.claimant
    sentences = []
    waiting = [record for record in lease.stopped if not record.restored]
    stopped = [r.holder for r in waiting if r.state is StepState.DONE]
    planned = [r.holder for r in waiting if r.state is not StepState.DONE]
    if stopped:
        sentences.append(
            f"For {lease.claimant}, {_and(stopped)} {'was' if len(stopped) == 1 else 'were'} "
            f"stopped; {'it' if len(stopped) == 1 else 'they'} will be started again when "
            + (
                f"{lease.claimant} releases its lease."
                if lease.mode is Mode.EXCLUSIVE
                else f"the last shared lease on {', '.join(lease.tokens)} ends."
            )
        )
    if planned and lease.state is LeaseState.ACQUIRING:
        sentences.append(f"Its claim had still to stop {_and(planned)}.")
    pending = [token for token, step in lease.switched if step is not StepState.DONE]
    if pending and lease.state is LeaseState.ACQUIRING:
        target = "vfio-pci" if lease.mode is Mode.EXCLUSIVE else "its home driver"
        sentences.append(f"The switch of {_and(pending)} to {target} was planned but not done.")
    if pending and lease.state is LeaseState.RELEASING:
        sentences.append(f"{_and(pending)} had still to be sent home.")
    sentences += _sleep(lease, facts)
    if lease.claimant in facts.status.stranded and _screen_not_back(lease):
        sentences += _screen_story(lease, facts)
    elif lease.claimant in facts.status.stranded:
        sentences.append(
            f"The lease of {lease.claimant} is stranded: {stranded_why(lease, facts.boot_id)}. "
            f"Fix: run {cli_command('restore', operands=[lease.claimant])} (it brings back "
            "what was stopped, sends the GPU home and drops the lease)."
        )
    elif lease.state is not LeaseState.ACTIVE:
        by = f" by process {lease.owner.pid}" if lease.owner else ""
        sentences.append(f"{who[0].upper()}{who[1:]} is {lease.state} right now{by}.")
    return sentences


def _screen_not_back(lease: Lease) -> tuple[str, ...]:
    """The display managers a finished release could not bring back (it tried: its
    writer is gone and the record is still there, stopped)."""
    if lease.state is not LeaseState.RELEASING or lease.owner is not None:
        return ()
    return tuple(
        record.holder.name
        for record in lease.unrestored()
        if record.holder.kind is HolderKind.DISPLAY_MANAGER and record.state is StepState.DONE
    )


def _screen_story(lease: Lease, facts: Facts) -> list[str]:
    """Finding F2: a kept lease whose display manager did not come back, what the person
    in front of the screen has instead, what the journal said, and what to do."""
    units = _screen_not_back(lease)
    failures = [
        r
        for r in facts.history
        if r.kind == EventKind.RESTORE_FAILED
        and r.get("claimant") == lease.claimant
        and r.get("holder").removeprefix(f"{HolderKind.DISPLAY_MANAGER}:") in units
    ]
    sentences = [
        f"The lease of {lease.claimant} is stranded: {stranded_why(lease, facts.boot_id)}."
    ]
    if failures:
        last = failures[-1]
        console = last.get("console")
        sentences.append(
            f"At {_when(last.time, facts)}: {last.get('why')}"
            + ("." if console else "; the console has no text login either.")
        )
        journal = [line for line in last.get("journal").splitlines() if line.strip()]
        if journal:
            sentences.append(f"Its journal ended with: {' / '.join(journal[-5:])}.")
    unit = units[0]
    sentences.append(
        f"Fix: read `journalctl -u {unit}`, mend what it says, then run "
        f"{cli_command('restore', operands=[lease.claimant])}: it starts {unit} again, "
        "checks that it draws on the GPU, and drops the lease (your session itself is "
        "gone: you get the login screen back, not what was open in it)."
    )
    return sentences


def _sleep(lease: Lease, facts: Facts) -> list[str]:
    """Whether the host may suspend while the lease passes its GPUs through."""
    if lease.mode is not Mode.EXCLUSIVE or lease.is_operation:
        return []
    sleep = facts.status.sleep
    held = [f'"{why}"' for token in lease.tokens if (why := sleep.lock_of(token)) is not None]
    if held:
        return [
            "Sleep is blocked while it is passed through: a logind inhibitor lock (what "
            f"sleep, who charly-arbiter) says {_and(held)}; it is let go when the lease "
            "is released."
        ]
    missing = [token for token in lease.tokens if token in sleep.missing]
    if missing:
        cause = lease.sleep_lock_error or sleep.unavailable or "its lock is not held"
        return [
            f"Sleep is NOT blocked while {_and(missing)} {'is' if len(missing) == 1 else 'are'} "
            f"passed through: {cause}; the host may suspend under {lease.claimant}, which "
            f"would lose its GPU. Fix: once the host can hold the lock (systemd running), run "
            f"{cli_command('restore', '--stranded')}, which takes it; or set "
            '`sleep = "allow"` in arbiter.toml to accept it.'
        ]
    if sleep.policy == "allow" and lease.state is LeaseState.ACTIVE:
        return ['Sleep is allowed while it is passed through (`sleep = "allow"`).']
    return []


def stranded_why(lease: Lease, boot_id: str) -> str:
    """Why a stranded lease will never end by itself, as a clause (`status --json` too)."""
    if lease.boot_id != boot_id:
        return "it was made before the last reboot"
    units = _screen_not_back(lease)
    away = [token for token, step in lease.switched if step is not StepState.DONE]
    if units and away:
        return (
            f"the display manager {', '.join(units)} waits for {', '.join(away)}, which did "
            "not come home"
        )
    if units:
        return (
            f"the display manager {', '.join(units)} did not come back when "
            f"{', '.join(lease.tokens)} came home"
        )
    if lease.state is not LeaseState.ACTIVE:
        writer = f" (pid {lease.owner.pid})" if lease.owner else ""
        return (
            f"the process that was {lease.state} it{writer} is gone, so the claim stopped half-way"
        )
    return f"{lease.claimant} is not running any more"


def _poison(token: TokenStatus, facts: Facts) -> list[str]:
    if not token.poisoned:
        return []
    return [
        f"{token.name} is poisoned since {_when(token.since, facts)}: {token.reason}.",
        "Nothing will claim or switch it until an operator clears the poison.",
        f"Fix: check the GPU and its driver by hand (`lspci -nnk -s {token.address}`), "
        f"then run {cli_command('poison', 'clear', operands=[token.name])}.",
    ]


def _last_trouble(
    indexed: Sequence[tuple[int, Record]], facts: Facts, scope: str, claimant: str | None = None
) -> list[str]:
    sentences = []
    refusals = [
        r
        for _, r in indexed
        if r.kind == EventKind.REFUSED and claimant in (None, r.get("claimant"))
    ]
    if refusals:
        last = refusals[-1]
        sentences.append(
            f"The last refused claim {scope} was {last.get('claimant')}'s for {last.get('token')}"
            f" at {_when(last.time, facts)}: {last.get('why')}."
        )
    failures = [
        r
        for _, r in indexed
        if r.kind in (EventKind.FAILED, EventKind.POISONED, EventKind.RESTORE_FAILED)
    ]
    if failures:
        last = failures[-1]
        sentences.append(
            f"The last failure {scope} was at {_when(last.time, facts)}: "
            f"{describe(last.kind, last.fields)}."
        )
    return sentences


def _interrupted(claimants: set[str], facts: Facts, only_token: str | None = None) -> list[str]:
    sentences = []
    for index in sorted(facts.interrupted):
        record = facts.history[index]
        if record.get("claimant") not in claimants:
            continue
        if only_token is not None and record.tokens and only_token not in record.tokens:
            continue
        sentence = (
            f"The history shows that process {record.pid} was killed at this step, "
            f"started {_when(record.time, facts)}: {describe(record.kind, record.fields)}"
        )
        restored = [
            later
            for later in facts.history[index + 1 :]
            if later.kind == EventKind.RESTORE and later.get("claimant") == record.get("claimant")
        ]
        if restored:
            sentence += f"; `restore` cleaned up after it at {_when(restored[0].time, facts)}"
        sentences.append(sentence + ".")
    return sentences


def _when(moment: str | datetime, facts: Facts) -> str:
    """The time as every output shows it (`human_time`), and how long ago it was."""
    when = as_time(moment)
    if when is None:
        return str(moment) or "an unknown time"
    return f"{human_time(when)} ({age(facts.now - when)} ago)"


def age(delta: timedelta) -> str:
    """A short duration: 45 s, 12 min, 3 h 5 min, 2 d 4 h."""
    seconds = int(max(0.0, delta.total_seconds()))
    if seconds < 60:
        return f"{seconds} s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if hours < 1:
        return f"{minutes} min"
    if days < 1:
        return f"{hours} h {minutes % 60} min"
    return f"{days} d {hours % 24} h"


def _and(names: Sequence[str]) -> str:
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} and {names[-1]}"
