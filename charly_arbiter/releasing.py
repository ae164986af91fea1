"""Releasing a lease: send its GPUs home and bring back what it stopped.

Used by `release` (a VM stopped), by `restore` (a stranded lease) and by an
acquire that failed half-way (its rollback).  Like acquiring, it commits its
intent first (the lease turns `releasing`, each token's way home planned),
acts outside the lock, and records each step, so that a crash leaves a lease
`restore` can finish.  A shared lease that is not the last on its GPU sends
nothing home: what it stopped belongs to the GPU, and moves to a lease that
stays.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from charly_arbiter.crashpoints import crashpoint
from charly_arbiter.errors import ArbiterError, LeaseInProgress, SwitchFailed
from charly_arbiter.events import drivers_label
from charly_arbiter.host import TokenSpec
from charly_arbiter.liveness import pid_alive
from charly_arbiter.model import (
    VFIO,
    Claimant,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    StepState,
    StoppedHolder,
    now,
)
from charly_arbiter.planner import blocks_token, home_map

if TYPE_CHECKING:
    from charly_arbiter.arbiter import Arbiter

log = logging.getLogger(__name__)


class Releaser:
    """The release steps, over the arbiter's ledger, host and events."""

    def __init__(self, arbiter: Arbiter) -> None:
        self.arbiter = arbiter
        self.ledger = arbiter.ledger
        self.host = arbiter.host
        self.events = arbiter.events
        self.pid = arbiter.pid

    def release_claimant(self, claimant: str, success: bool = True, reason: str = "") -> bool:
        """Remove the claimant's lease; the last lease on a token sends it home and
        brings back what was stopped for it.  Returns False when there was no lease.

        Failures restoring holders are logged and leave the lease for `restore`;
        this never raises for them, because it runs when a VM stops.
        """
        claimant = str(Claimant.parse(claimant))
        if self.ledger.read().lease_of(claimant) is None:
            return False
        self.events.emit(
            "release" if success else "failed", claimant=claimant, why=reason or "released"
        )
        return self.finish(claimant, success, reason)

    def finish(self, claimant: str, success: bool, reason: str) -> bool:
        current = self.ledger.read().lease_of(claimant)
        if current is None:
            return False
        holder_tokens = self._holder_tokens(current)  # outside the lock: this may ask libvirt
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is None:
                return False
            if self._owned_by_another_live_process(lease):
                # Tearing down a claim another process is still carrying out
                # would race with its steps; it finishes (or rolls back) itself.
                raise LeaseInProgress(claimant, str(lease.state), lease.owner_pid)
            lease, txn.state = self._release_intent_unlocked(
                txn.state, lease, success, reason, holder_tokens
            )
        crashpoint("release.intent")
        if lease is None:
            return True
        tokens = {spec.name: spec for spec in self.arbiter.known_specs(lease.tokens)}
        complete = True
        for name in lease.tokens:
            if lease.switch_state(name) is StepState.DONE:
                continue
            complete &= self._send_home(claimant, tokens.get(name))
        complete &= self._restore_holders(claimant, holder_tokens)
        crashpoint("release.restored")
        with self.ledger.transaction() as txn:
            current = txn.state.lease_of(claimant)
            if current is None:
                return True
            if complete:
                txn.state = txn.state.without_lease(claimant)
            else:
                txn.state = txn.state.with_lease(replace(current, owner_pid=0))
        if not complete:
            log.error("%s: release incomplete; run `charly-arbiter restore %s`", claimant, claimant)
        return True

    def _owned_by_another_live_process(self, lease: Lease) -> bool:
        return (
            lease.state is not LeaseState.ACTIVE
            and lease.owner_pid not in (0, self.pid)
            and lease.boot_id == self.host.boot_id()
            and pid_alive(lease.owner_pid)
        )

    def _holder_tokens(self, lease: Lease) -> dict[str, set[str]]:
        """Which tokens each holder the lease stopped uses (for hand-overs)."""
        try:
            holders = self.host.holders(list(self.arbiter.tokens().values()))
        except ArbiterError as error:
            log.warning("%s: cannot list the holders: %s", lease.claimant, error)
            holders = []
        found = {holder.ref: set(holder.tokens) for holder in holders}
        for record in lease.stopped:
            if record.shared_tokens:
                found[record.holder] = set(record.shared_tokens)
        return found

    def _release_intent_unlocked(
        self,
        state: LedgerState,
        lease: Lease,
        success: bool,
        reason: str,
        holder_tokens: dict[str, set[str]] | None = None,
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
                uses = (holder_tokens or {}).get(record.holder, set(lease.tokens)) & held
                heir = next(
                    (
                        heir_lease
                        for name in heirs
                        if (heir_lease := state.lease_of(name)) is not None
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
            owner_pid=self.pid,
            switched=tuple(sorted(switched)),
            note=note or lease.note,
        )
        return releasing, state.with_lease(releasing)

    def _send_home(self, claimant: str, token: TokenSpec | None) -> bool:
        if token is None:
            return True
        state = self.ledger.read()
        if state.poison_of(token.name) is not None:
            log.warning("%s: poisoned, left where it is", token.name)
        else:
            home = home_map(state, token)
            current = {f.address: f.driver for f in self.arbiter.fresh_functions(token)}
            targets = {
                address: driver
                for address, driver in home.items()
                if current.get(address) == VFIO or (driver and current.get(address) != driver)
            }
            if targets:
                self.events.emit(
                    "switching", claimant=claimant, token=token.name, driver=drivers_label(targets)
                )
                crashpoint("release.switch")
                try:
                    self.arbiter.switch_token(token, targets, claimant)
                except SwitchFailed as error:
                    log.error("%s: could not return home: %s", token.name, error)
                    return False
            if token.cdi:
                self.arbiter.regenerate_cdi(token)
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                txn.state = txn.state.with_lease(lease.with_switch(token.name, StepState.DONE))
        return True

    def _restore_holders(
        self, claimant: str, holder_tokens: dict[str, set[str]] | None = None
    ) -> bool:
        lease = self.ledger.read().lease_of(claimant)
        if lease is None:
            return True
        complete = True
        for record in reversed(lease.stopped):
            if record.restored:
                continue
            crashpoint("release.start")
            try:
                uses = (holder_tokens or {}).get(record.holder, set())
                if self._hand_to_exclusive_holder(claimant, record, uses):
                    continue
                self._restore_one(claimant, record)
            except ArbiterError as error:
                log.error("%s: could not restore %s: %s", claimant, record.holder, error)
                self.events.emit(
                    "restore-failed", claimant=claimant, holder=record.holder, why=str(error)
                )
                complete = False
        return complete

    def _hand_to_exclusive_holder(
        self, claimant: str, record: StoppedHolder, uses: set[str]
    ) -> bool:
        """Give the record to an exclusive lease that now holds one of the holder's
        tokens, instead of starting the holder under it; that lease brings it back."""
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            heir = next(
                (
                    other
                    for other in txn.state.leases
                    if other.claimant != claimant
                    and other.mode is Mode.EXCLUSIVE
                    and other.state is not LeaseState.RELEASING
                    and any(blocks_token(other, token) for token in uses)
                ),
                None,
            )
            if lease is None or heir is None:
                return False
            if all(r.holder != record.holder or r.restored for r in heir.stopped):
                txn.state = txn.state.with_lease(heir.with_stopped(record))
            lease = txn.state.lease_of(claimant) or lease
            txn.state = txn.state.with_lease(lease.with_stopped(replace(record, restored=True)))
        log.info("%s: %s stays stopped for %s", claimant, record.holder, heir.claimant)
        return True

    def _restore_one(self, claimant: str, record: StoppedHolder) -> None:
        """Start the holder again and give a shared claimant its lease back."""
        state = self.ledger.read()
        elsewhere = [
            lease
            for lease in state.leases
            if lease.claimant != claimant
            and any(r.holder == record.holder and not r.restored for r in lease.stopped)
        ]
        if elsewhere:
            # Another claim stopped it too; that one brings it back.
            self._mark_restored(claimant, record)
            return
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
        if record.shared_tokens and self.host.is_running(record.holder):
            self._reinstate_shared_lease(record)
        self._mark_restored(claimant, record)

    def _reinstate_shared_lease(self, record: StoppedHolder) -> None:
        boot_id = self.host.boot_id()
        with self.ledger.transaction() as txn:
            if txn.state.lease_of(record.holder) is None:  # its own hook may have done it
                txn.state = txn.state.with_lease(
                    Lease(
                        claimant=record.holder,
                        mode=Mode.SHARED,
                        tokens=record.shared_tokens,
                        state=LeaseState.ACTIVE,
                        transient=False,
                        boot_id=boot_id,
                        created=now(),
                    )
                )

    def _mark_restored(self, claimant: str, record: StoppedHolder) -> None:
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                txn.state = txn.state.with_lease(lease.with_stopped(replace(record, restored=True)))
