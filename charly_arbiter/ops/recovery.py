"""Recovering from a corrupt ledger: only when an operator asks, after seeing the facts.

A ledger written with temp+fsync+rename is never torn by a crash, so one that
does not verify means something else went wrong (a disk, a hand edit, an
attacker).  Nothing repairs it by itself: every mutating command fails closed.
`charly-arbiter recover` shows what the backup (the previous generation) says
next to what the host shows; only `--yes` writes, moving the corrupt file
aside.  Where there is no usable backup, `--empty` starts over with every
token found on vfio-pci poisoned, so nothing is handed out before a person has
looked at it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.model import VFIO, Claimant, LeaseState, LedgerState, Mode, Poison, now
from charly_arbiter.errors import ArbiterError, LedgerCorrupt, Refused, cli_command


@dataclass(frozen=True)
class Comparison:
    """The corrupt ledger, its backup, and where the host disagrees with the backup."""

    corrupt: LedgerCorrupt | None  # None: the ledger verifies, nothing to recover
    backup: LedgerState | None
    backup_problem: str  # why the backup cannot be used ("" when it can)
    lines: tuple[str, ...]  # what the backup says, then the host's disagreements
    on_vfio: tuple[str, ...]  # tokens with a function on vfio-pci right now


def compare(arbiter: Arbiter) -> Comparison:
    reading = arbiter.ledger.inspect()
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
            f"the backup is generation {backup.generation} with {len(backup.leases)} leases"
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
            lines.append(f"  {token} poisoned since {poison.since}: {poison.reason}")
        lines += _disagreements(backup, drivers)
    return Comparison(reading.corrupt, backup, problem, tuple(lines), on_vfio)


def recover(
    arbiter: Arbiter, comparison: Comparison, *, empty: bool
) -> tuple[LedgerState, Path | None]:
    """Write the chosen state over the corrupt ledger (moved aside); returns both."""
    if comparison.corrupt is None:
        raise ArbiterError("the ledger verifies; there is nothing to recover")
    if empty:
        state = LedgerState(
            generation=comparison.backup.generation if comparison.backup else 0,
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
        state = comparison.backup
    aside = arbiter.ledger.replace_corrupt(state)
    arbiter.events.emit(
        "recovered", why=comparison.corrupt.why, source="empty" if empty else "backup"
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
        if on_vfio and not exclusive and backup.poison_of(token) is None:
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
