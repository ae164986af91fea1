"""Releasing a lease: send its GPUs home and bring back what it stopped.

Used by `release` (a VM stopped), by `restore` (a stranded lease) and by an
acquire that failed half-way (its rollback).  Like acquiring, it commits its
intent first (the lease turns `releasing`, each token's way home planned),
acts outside the lock, and records each step, so that a crash leaves a lease
`restore` can finish.  A shared lease that is not the last on its GPU sends
nothing home: what it stopped belongs to the GPU, and moves to a lease that
stays.

Bringing a holder back is decided under the lock, one holder at a time: if an
exclusive lease now holds one of the holder's tokens, the record moves to that
lease (it brings the holder back when it ends); otherwise the record turns
STARTING, which keeps any new exclusive claim on those tokens waiting until
the holder runs (and, for a preempted shared claimant, has its lease back).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from charly_arbiter.core.crashpoints import crashpoint
from charly_arbiter.core.events import Events, drivers_label
from charly_arbiter.core.host import Host, TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import (
    VFIO,
    Claimant,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    ProcessRef,
    StepState,
    StoppedHolder,
    now,
)
from charly_arbiter.core.planner import blocks_token, home_map
from charly_arbiter.core.switching import Switching
from charly_arbiter.core.tokens import TokenCatalogue
from charly_arbiter.errors import ArbiterError, ClaimantRunning, LeaseInProgress, SwitchFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Comeback:
    """What to do about one stopped holder, decided under the lock."""

    record: StoppedHolder
    start: bool  # False: handed to another lease, or another lease brings it back


class Releaser:
    """The release steps, over a ledger, a host and its tokens, as process `owner`."""

    def __init__(
        self,
        ledger: Ledger,
        host: Host,
        events: Events,
        tokens: TokenCatalogue,
        switching: Switching,
        owner: ProcessRef,
    ) -> None:
        self.ledger = ledger
        self.host = host
        self.events = events
        self.tokens = tokens
        self.switching = switching
        self.owner = owner

    def release_claimant(
        self, claimant: str, success: bool = True, reason: str = "", *, force: bool = False
    ) -> bool:
        """See `Arbiter.release_claimant`."""
        lease = self.ledger.read().lease_of(Claimant.parse(claimant))
        if lease is None:
            return False
        if not force and self._still_runs(lease):
            raise ClaimantRunning(lease.claimant, "releasing")
        self.events.emit(
            "release" if success else "failed", claimant=lease.claimant, why=reason or "released"
        )
        return self.finish(lease.claimant, success, reason)

    def begin(self, claimant: str, success: bool, reason: str) -> bool:
        """Only the first step: mark the lease releasing, under the lock.

        The libvirt hook does this before it hands the rest to a detached
        process, so that a `prepare` of the same VM right after (destroy, then
        start) finds the lease releasing and waits, instead of finding it
        active and starting the VM without one.  False when there is no lease.
        """
        claimant = Claimant.parse(claimant)
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is None:
                return False
            self._refuse_if_in_progress(lease)
            _, txn.state = self._release_intent_unlocked(txn.state, lease, success, reason)
        self.events.emit(
            "release" if success else "failed", claimant=claimant, why=reason or "released"
        )
        crashpoint("release.intent")
        return True

    def finish(
        self, claimant: str, success: bool, reason: str, takeover: ProcessRef | None = None
    ) -> bool:
        """Release the lease to the end.  `takeover` is the process that began this
        release and handed it on (the hook): its lease is continued, not refused."""
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is None:
                return False
            if (
                takeover is not None
                and lease.state is LeaseState.RELEASING
                and lease.owner == takeover
            ):
                releasing: Lease | None = lease.owned_by(self.owner)
                txn.state = txn.state.with_lease(lease.owned_by(self.owner))
            else:
                self._refuse_if_in_progress(lease)
                releasing, txn.state = self._release_intent_unlocked(
                    txn.state, lease, success, reason
                )
        crashpoint("release.intent")
        if releasing is None:
            return True
        self.carry_out(releasing.claimant, releasing)
        return True

    def carry_out(self, claimant: Claimant, lease: Lease) -> None:
        """Everything after the intent: tokens home, holders back, the lease gone."""
        tokens = {spec.name: spec for spec in self.tokens.known(lease.tokens)}
        for name in lease.tokens:
            if lease.switch_state(name) is not StepState.DONE:
                self._send_home(claimant, tokens.get(name))
        attempted: set[str] = set()
        while True:
            self._restore_holders(claimant, attempted)
            crashpoint("release.restored")
            with self.ledger.transaction() as txn:
                current = txn.state.lease_of(claimant)
                if current is None:
                    return
                if any(r.holder not in attempted for r in current.unrestored()):
                    continue  # handed to this lease meanwhile: bring those back too
                done = not current.unrestored() and all(
                    step is StepState.DONE for _, step in current.switched
                )
                if done:
                    txn.state = txn.state.without_lease(claimant)
                else:
                    txn.state = txn.state.with_lease(current.owned_by(None))
            break
        if not done:
            log.error("%s: release incomplete; run `charly-arbiter restore %s`", claimant, claimant)

    def _still_runs(self, lease: Lease) -> bool:
        return (
            lease.state is LeaseState.ACTIVE
            and lease.boot_id == self.host.boot_id()
            and self.host.is_running(lease.claimant)
        )

    def _refuse_if_in_progress(self, lease: Lease) -> None:
        """Tearing down a claim another live process is still carrying out would
        race with its steps; it finishes (or rolls back) itself."""
        owner = lease.owner
        if (
            lease.state is not LeaseState.ACTIVE
            and owner is not None
            and owner != self.owner
            and lease.boot_id == self.host.boot_id()
            and self.host.process_alive(owner)
        ):
            raise LeaseInProgress(lease.claimant, str(lease.state), owner.pid)

    def _release_intent_unlocked(
        self, state: LedgerState, lease: Lease, success: bool, reason: str
    ) -> tuple[Lease | None, LedgerState]:
        """Mark the lease releasing, handing stopped holders to a lease that stays.

        A shared lease that is not the last on a token sends that token nothing
        home; a holder it stopped for such a token belongs to the token, so its
        record moves to a remaining shared lease on it (never to one that is
        itself releasing: that one may already have read its list).  Holders of
        tokens nobody else holds are restored as for the last lease.
        """
        others = [
            other
            for other in state.leases
            if other.claimant != lease.claimant
            and any(blocks_token(other, token) for token in lease.tokens)
        ]
        heirs = [
            other.claimant
            for other in others
            if other.mode is Mode.SHARED and other.state is not LeaseState.RELEASING
        ]
        if lease.mode is Mode.SHARED and heirs and lease.state is not LeaseState.RELEASING:
            held = {t for t in lease.tokens if any(blocks_token(o, t) for o in others)}
            kept = []
            for record in lease.stopped:
                uses = set(record.tokens or lease.tokens) & held
                heir = next(
                    (
                        heir_lease
                        for name in heirs
                        if name != record.holder  # never the holder's own lease
                        and (heir_lease := state.lease_of(name)) is not None
                        and uses & set(heir_lease.tokens)
                    ),
                    None,
                )
                if record.restored or heir is None:
                    kept.append(record)
                else:
                    state = state.with_lease(heir.with_stopped(record))
            if held == set(lease.tokens) and all(record.restored for record in kept):
                return None, state.without_lease(lease.claimant)
            lease = replace(lease, stopped=tuple(kept))
        note = reason if reason else ("" if success else "failed")
        switched = []
        for token in lease.tokens:
            # An acquire that never switched a token left it where it was: not ours to move.
            untouched = lease.state is LeaseState.ACQUIRING and lease.switch_state(token) is None
            gone_home = lease.state is LeaseState.RELEASING and (
                lease.switch_state(token) is StepState.DONE
            )
            shared_by_others = any(token in other.tokens for other in others)
            done = untouched or gone_home or shared_by_others
            switched.append((token, StepState.DONE if done else StepState.PLANNED))
        releasing = replace(
            lease,
            state=LeaseState.RELEASING,
            switched=tuple(sorted(switched)),
            note=note or lease.note,
        ).owned_by(self.owner)
        return releasing, state.with_lease(releasing)

    def _send_home(self, claimant: Claimant, token: TokenSpec | None) -> None:
        if token is None:
            return
        state = self.ledger.read()
        if state.poison_of(token.name) is not None:
            log.warning("%s: poisoned, left where it is", token.name)
        else:
            home = home_map(state, token)
            current = {f.address: f.driver for f in self.tokens.functions_now(token)}
            targets = {
                address: driver
                for address, driver in home.items()
                # (A home of vfio-pci, `adopt --admin`'s, is where it stays.)
                if (current.get(address) == VFIO and driver != VFIO)
                or (driver and current.get(address) != driver)
            }
            if targets:
                self.events.emit(
                    "switching", claimant=claimant, token=token.name, driver=drivers_label(targets)
                )
                crashpoint("release.switch")
                try:
                    self.switching.switch(token, targets, claimant)  # CDI follows it
                except SwitchFailed as error:
                    log.error("%s: could not return home: %s", token.name, error)
                    return
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                txn.state = txn.state.with_lease(lease.with_switch(token.name, StepState.DONE))

    def _restore_holders(self, claimant: Claimant, attempted: set[str]) -> None:
        """Bring back, one by one, every holder the lease still records (including
        records handed to it meanwhile), newest first; `attempted` are the ones this
        release has dealt with already."""
        while True:
            comeback = self._next_comeback(claimant, attempted)
            if comeback is None:
                return
            record = comeback.record
            attempted.add(record.holder)
            if not comeback.start:
                continue
            crashpoint("release.start")
            try:
                self._start(claimant, record)
            except ArbiterError as error:
                log.error("%s: could not restore %s: %s", claimant, record.holder, error)
                self.events.emit(
                    "restore-failed", claimant=claimant, holder=record.holder, why=str(error)
                )
                self._set_record(claimant, replace(record, state=StepState.DONE))
                continue
            self._came_back(claimant, record)

    def _next_comeback(self, claimant: Claimant, attempted: set[str]) -> _Comeback | None:
        """Under the lock: hand the next record on, or mark it STARTING."""
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is None:
                return None
            pending = [r for r in reversed(lease.unrestored()) if r.holder not in attempted]
            if not pending:
                return None
            record = pending[0]
            heir = _exclusive_heir(txn.state, claimant, record)
            if heir is None and record.shared_tokens and _still_holds(lease, record):
                # Its GPU is still on vfio-pci under this very lease (its way home
                # failed): the shared claimant cannot have its lease back beside it.
                log.warning(
                    "%s: %s stays stopped while %s is not home",
                    claimant,
                    record.holder,
                    ", ".join(record.shared_tokens),
                )
                return _Comeback(record, start=False)
            if heir is not None:
                # It stays stopped; the lease that now holds its GPU brings it back.
                if all(r.holder != record.holder for r in heir.unrestored()):
                    txn.state = txn.state.with_lease(
                        heir.with_stopped(replace(record, state=StepState.DONE))
                    )
                lease = txn.state.lease_of(claimant) or lease
                txn.state = txn.state.with_lease(lease.with_stopped(replace(record, restored=True)))
                log.info("%s: %s stays stopped for %s", claimant, record.holder, heir.claimant)
                return _Comeback(record, start=False)
            if any(
                other.claimant != claimant
                and any(r.holder == record.holder for r in other.unrestored())
                for other in txn.state.leases
            ):
                # Another claim stopped it too; that one brings it back.
                txn.state = txn.state.with_lease(lease.with_stopped(replace(record, restored=True)))
                return _Comeback(record, start=False)
            starting = replace(record, state=StepState.STARTING)
            txn.state = txn.state.with_lease(lease.with_stopped(starting))
            return _Comeback(starting, start=True)

    def _start(self, claimant: Claimant, record: StoppedHolder) -> None:
        # A planned stop may have happened just before a crash: whatever is not
        # running now was running when the claim was decided.
        if not self.host.is_running(record.holder):
            log.info("%s: starting %s again", claimant, record.holder)
            self.events.emit("starting", claimant=claimant, holder=record.holder)
            self.host.start(record.holder)
            if not self.host.is_running(record.holder):
                log.warning(
                    "%s: %s cannot be started again (a terminated process)", claimant, record.holder
                )
        self.events.emit("restored", claimant=claimant, holder=record.holder)

    def _came_back(self, claimant: Claimant, record: StoppedHolder) -> None:
        """Mark it restored, and give a preempted shared claimant its lease back.

        While the record was STARTING no exclusive claim could take its tokens,
        so the shared lease can be recreated without checking again; but only on
        the tokens that are home.  One left on vfio-pci (poisoned on its way home)
        is not shared by anyone: a lease there would say it is in use on its home
        driver, and clearing the poison would then leave a GPU on vfio-pci with no
        exclusive lease (I2).  Its next claim is refused for the poison, saying why.
        """
        running = bool(record.shared_tokens) and self.host.is_running(record.holder)
        home_tokens = tuple(
            spec.name
            for spec in self.tokens.known(record.shared_tokens)
            if running and all(f.driver != VFIO for f in self.tokens.functions_now(spec))
        )
        boot_id = self.host.boot_id()
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                txn.state = txn.state.with_lease(lease.with_stopped(replace(record, restored=True)))
            # Nothing may have taken them meanwhile (the planner waits for a STARTING
            # record); should a claim have got in all the same, the lease is not
            # recreated beside it: the holder comes back without it, loudly.
            taken = taken_meanwhile(txn.state, claimant, record, home_tokens)
            if taken:
                log.error(
                    "%s: %s gets no shared lease back: %s held exclusively meanwhile",
                    claimant,
                    record.holder,
                    ", ".join(taken),
                )
                home_tokens = ()
            if home_tokens and txn.state.lease_of(record.holder) is None:
                # (Its own hook may already have claimed again while it started.)
                txn.state = txn.state.with_lease(
                    Lease(
                        claimant=record.holder,
                        mode=Mode.SHARED,
                        tokens=home_tokens,
                        state=LeaseState.ACTIVE,
                        transient=False,
                        boot_id=boot_id,
                        created=now(),
                    )
                )

    def _set_record(self, claimant: Claimant, record: StoppedHolder) -> None:
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                txn.state = txn.state.with_lease(lease.with_stopped(record))


def taken_meanwhile(
    state: LedgerState, claimant: Claimant, record: StoppedHolder, tokens: tuple[str, ...]
) -> list[str]:
    """Which of `tokens` another exclusive lease holds: the shared lease of the
    holder `claimant` brought back must not be recreated there (the last guard
    of I1; the planner's waiting for STARTING records is the first)."""
    return [
        token
        for token in dict.fromkeys(tokens)
        if any(
            other.mode is Mode.EXCLUSIVE
            and other.claimant not in (claimant, record.holder)
            and blocks_token(other, token)
            for other in state.leases
        )
    ]


def _exclusive_heir(state: LedgerState, claimant: Claimant, record: StoppedHolder) -> Lease | None:
    """Another exclusive lease that holds one of the holder's tokens, in any state: a
    releasing one too, since it brings back every record it holds before it ends."""
    uses = record.tokens or record.shared_tokens
    return next(
        (
            other
            for other in state.leases
            if other.claimant not in (claimant, record.holder)
            and other.mode is Mode.EXCLUSIVE
            and any(blocks_token(other, token) for token in uses)
        ),
        None,
    )


def _still_holds(lease: Lease, record: StoppedHolder) -> bool:
    """Whether `lease`, exclusive, still holds one of the tokens `record` shared."""
    return lease.mode is Mode.EXCLUSIVE and any(
        blocks_token(lease, token) for token in record.shared_tokens
    )
