"""Recovering from a corrupt ledger, or one that went backwards: only when an operator
asks, after seeing the facts.

A ledger written with temp+fsync+rename is never torn by a crash, so one that
does not verify means something else went wrong (a disk, a hand edit, an
attacker).  Nothing repairs it by itself: every mutating command fails closed.
`charly-arbiter recover` shows what the backup (the previous generation) says
next to what the host shows; only `--yes` writes, moving the corrupt file
aside.  Where there is no usable backup, `--empty` starts over with every
token found on vfio-pci poisoned, so nothing is handed out before a person has
looked at it.

A ledger that verifies but is behind the history (deleted, or replaced by an
older or an empty one) is refused the same way: `recover` shows what the history
says the lost ledger held (who held which GPU, what it had stopped) next to the
host, and `--yes` continues from the ledger as it is, its generation raised past
the history's.  A GPU it then does not account for (on vfio-pci, no lease) is
settled token by token with `adopt` or `send-home`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from charly_arbiter.core.arbiter import Arbiter, rollback_found
from charly_arbiter.core.events import EventKind, count_of
from charly_arbiter.core.model import (
    VFIO,
    Claimant,
    LeaseState,
    LedgerState,
    Mode,
    Poison,
    human_time,
    now,
)
from charly_arbiter.core.planner import unaccounted
from charly_arbiter.errors import ArbiterError, LedgerCorrupt, Refused, cli_command
from charly_arbiter.ops.history import Record, last_holder


@dataclass(frozen=True)
class Comparison:
    """The corrupt ledger, its backup, and where the host disagrees with the backup."""

    corrupt: LedgerCorrupt | None  # None: the ledger verifies, nothing to recover
    backup: LedgerState | None
    backup_problem: str  # why the backup cannot be used ("" when it can)
    lines: tuple[str, ...]  # what the backup says, then the host's disagreements
    on_vfio: tuple[str, ...]  # tokens with a function on vfio-pci right now
    history_generation: int = 0  # the highest generation the history recorded
    # The ledger verifies but is behind the history: it went backwards.
    went_back: bool = False
    unaccounted: tuple[str, ...] = ()  # tokens on vfio-pci the ledger as it is has no lease on


def compare(arbiter: Arbiter, history: Sequence[Record] = ()) -> Comparison:
    recorded = arbiter.history_generation()  # (before the ledger, as the arbiter reads them)
    reading = arbiter.ledger.inspect()
    if reading.state is not None and recorded > reading.state.generation:
        return _went_back(arbiter, reading.state, recorded, history)
    try:
        backup: LedgerState | None = arbiter.ledger.backup_state()
        problem = ""
    except LedgerCorrupt as error:
        backup, problem = None, error.why
    drivers = {
        spec.name: {f.address: f.driver for f in spec.functions}
        for spec in arbiter.tokens.all().values()
    }
    on_vfio = tuple(name for name, found in drivers.items() if VFIO in found.values())
    lines: list[str] = []
    if backup is not None:
        lines.append(
            f"the backup is generation {backup.generation} with "
            f"{count_of(len(backup.leases), 'lease')}"
        )
        for lease in backup.leases:
            runs = _runs(arbiter, lease.claimant)
            lines.append(
                f"  {lease.claimant}: {lease.mode} on {', '.join(lease.tokens)}, {lease.state}"
                f"; the claimant {'runs' if runs else 'does not run'} now"
            )
            for record in lease.unrestored():
                state = "runs" if _runs(arbiter, record.holder) else "is stopped"
                lines.append(f"    stopped {record.holder}, which {state} now")
        for token, poison in backup.poisoned:
            lines.append(f"  {token} poisoned since {human_time(poison.since)}: {poison.reason}")
        lines += _disagreements(backup, drivers)
    return Comparison(reading.corrupt, backup, problem, tuple(lines), on_vfio, recorded)


def _went_back(
    arbiter: Arbiter, state: LedgerState, recorded: int, history: Sequence[Record]
) -> Comparison:
    """What the history says the lost ledger held, beside the host and the ledger as it is."""
    specs = list(arbiter.tokens.all().values())
    on_vfio = tuple(s.name for s in specs if any(f.driver == VFIO for f in s.functions))
    lost = tuple(s.name for s in specs if unaccounted(state, s))
    lines = [rollback_found(state.generation, recorded)]
    lines.append(f"the ledger as it is holds {count_of(len(state.leases), 'lease')}")
    said = False
    for spec in specs:
        story = last_holder(history, spec.name)
        if story is None:
            continue
        if not said:
            lines.append("the history says it held:")
            said = True
        runs = _runs(arbiter, Claimant.parse(story.claimant))
        lines.append(
            f"  {spec.name}: held by {story.claimant} (exclusive) since "
            f"{human_time(story.since)}; {story.claimant} {'runs' if runs else 'does not run'} now"
        )
        for holder in story.stopped:
            state_now = "runs" if _runs(arbiter, Claimant.parse(holder)) else "is stopped"
            lines.append(f"    it had stopped {holder}, which {state_now} now")
    if not said:
        lines.append("the history names no GPU held exclusively that was never released")
    for name in lost:
        lines.append(f"host: {name} is on vfio-pci, and the ledger as it is has no lease on it")
    return Comparison(
        None, None, "", tuple(lines), on_vfio, recorded, went_back=True, unaccounted=lost
    )


def recover(
    arbiter: Arbiter, comparison: Comparison, *, empty: bool
) -> tuple[LedgerState, Path | None]:
    """Write the chosen state over the corrupt ledger (moved aside), or, for a ledger
    that went backwards, write it again past the history's generation; returns the
    state written and where the corrupt file went.  The generation written is always
    past what the history recorded, so the ledger is not taken to have gone back."""
    floor = comparison.history_generation
    if comparison.went_back:
        with arbiter.ledger.transaction() as txn:
            behind = txn.state.generation
            txn.state = replace(txn.state, generation=max(behind, floor))
        state = arbiter.ledger.read()
        arbiter.events.emit(
            EventKind.RECOVERED, why=rollback_found(behind, floor), source="the ledger as it is"
        )
        return state, None
    if comparison.corrupt is None:
        raise ArbiterError("the ledger verifies; there is nothing to recover")
    if empty:
        state = LedgerState(
            generation=max(comparison.backup.generation if comparison.backup else 0, floor),
            poisoned=tuple(
                (token, Poison("found on vfio-pci when the ledger was recovered empty", now()))
                for token in comparison.on_vfio
            ),
        )
    elif comparison.backup is None:
        raise Refused(
            f"the backup cannot be used: {comparison.backup_problem}",
            hint=f"check the host by hand, then run {cli_command('recover', '--empty', '--yes')}",
        )
    else:
        state = replace(comparison.backup, generation=max(comparison.backup.generation, floor))
    aside = arbiter.ledger.replace_corrupt(state)
    arbiter.events.emit(
        EventKind.RECOVERED, why=comparison.corrupt.why, source="empty" if empty else "backup"
    )
    return state, aside


def _runs(arbiter: Arbiter, ref: Claimant) -> bool:
    try:
        return arbiter.host.is_running(ref)
    except ArbiterError:
        return False


def _disagreements(backup: LedgerState, drivers: dict[str, dict[str, str | None]]) -> list[str]:
    lines = []
    for token, found in sorted(drivers.items()):
        exclusive = [
            lease
            for lease in backup.leases_on(token)
            if lease.mode is Mode.EXCLUSIVE and lease.state is not LeaseState.RELEASING
        ]
        on_vfio = VFIO in found.values()
        on_purpose = all(
            backup.home_of(token).get(address) == VFIO
            for address, driver in found.items()
            if driver == VFIO
        )
        if on_vfio and not exclusive and backup.poison_of(token) is None and not on_purpose:
            lines.append(
                f"host: {token} is on vfio-pci, but the backup has no exclusive lease on it"
            )
        if exclusive and not on_vfio:
            lines.append(
                f"host: {token} is not on vfio-pci, but the backup says "
                f"{exclusive[0].claimant} holds it exclusively"
            )
    if not lines:
        lines.append("host: the drivers agree with the backup")
    return lines
