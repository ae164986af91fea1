"""Carrying out plans: acquire, release and restore, through an intent journal.

Each operation commits its intent to the ledger first (a lease in state
`acquiring` or `releasing`, listing what will be stopped and switched), lets
go of the lock, acts on the host, and records each step's outcome in its own
small transaction.  The lock is never held while the host is busy (stopping a
VM runs that VM's own hook, which calls back in here), and a crash at any
point leaves enough on disk for `restore` to converge.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from charly_arbiter.config import Config
from charly_arbiter.crashpoints import crashpoint
from charly_arbiter.errors import (
    ArbiterError,
    LeaseInProgress,
    SwitchFailed,
    UnknownToken,
)
from charly_arbiter.events import Events
from charly_arbiter.host import Host, PciFunction, TokenSpec
from charly_arbiter.ledger import Ledger
from charly_arbiter.model import (
    VFIO,
    Claimant,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    Poison,
    StepState,
    StoppedHolder,
)
from charly_arbiter.planner import (
    NO_POLICY,
    ClaimPlan,
    Policy,
    blocks_token,
    decide_claim,
    home_map,
)

log = logging.getLogger(__name__)


def now() -> str:
    return datetime.now(UTC).astimezone().isoformat(timespec="seconds")


@dataclass(frozen=True)
class TokenStatus:
    name: str
    address: str
    mode: str  # exclusive, shared or idle
    drivers: tuple[tuple[str, str | None], ...]
    poisoned: bool
    reason: str
    since: str
    claimants: tuple[str, ...]


@dataclass(frozen=True)
class Status:
    leases: tuple[Lease, ...]
    tokens: tuple[TokenStatus, ...]
    stranded: tuple[str, ...]
    generation: int
    corrupt: str | None = None


class Arbiter:
    def __init__(
        self, config: Config, host: Host, ledger: Ledger, events: Events | None = None
    ) -> None:
        self.config = config
        self.host = host
        self.ledger = ledger
        self.events = events or Events()
        # Written into in-progress leases; `restore` treats them as stranded
        # once this process is gone.
        self.pid = os.getpid()
        self._token_cache: dict[str, TokenSpec] | None = None

    # -- tokens ----------------------------------------------------------------

    def tokens(self) -> dict[str, TokenSpec]:
        """Configured tokens, or every detected GPU named after its address."""
        if self._token_cache is None:
            specs: dict[str, TokenSpec] = {}
            if self.config.tokens:
                for token in self.config.tokens:
                    functions = tuple(self.host.token_functions(token.name, token.address))
                    specs[token.name] = TokenSpec(
                        token.name, token.address, functions, token.home_driver, token.cdi
                    )
            else:
                for gpu in self.host.gpus():
                    functions = tuple(self.host.token_functions(gpu.address, gpu.address))
                    specs[gpu.address] = TokenSpec(gpu.address, gpu.address, functions)
            self._token_cache = specs
        return self._token_cache

    def resolve(self, names: Sequence[str]) -> list[TokenSpec]:
        known = self.tokens()
        missing = [name for name in names if name not in known]
        if missing:
            raise UnknownToken(missing[0], sorted(known))
        return [known[name] for name in dict.fromkeys(names)]

    def _resolve_fresh(self, names: Sequence[str]) -> list[TokenSpec]:
        """Like `resolve`, with each function's driver as bound right now (the
        cached specs keep the drivers seen when they were first built)."""
        return [
            replace(spec, functions=tuple(self._fresh_functions(spec)))
            for spec in self.resolve(names)
        ]

    def token_for_address(self, address: str) -> str | None:
        """The token one of whose functions is `address` (for claims read from XML)."""
        for spec in self.tokens().values():
            if any(function.address == address for function in spec.functions):
                return spec.name
        return None

    # -- deciding ------------------------------------------------------------------

    def plan(
        self,
        claimant: str,
        mode: Mode,
        token_names: Sequence[str],
        *,
        transient: bool = False,
        policy: Policy = NO_POLICY,
    ) -> ClaimPlan:
        """Decide a claim against the live host and ledger, changing nothing."""
        claimant = str(Claimant.parse(claimant))
        tokens = self._resolve_fresh(token_names)
        holders = self.host.holders(tokens)
        state = self.ledger.read()
        boot_id = self.host.boot_id()
        return decide_claim(
            state,
            claimant,
            mode,
            tokens,
            holders,
            self._stranded_unlocked(state, boot_id),
            transient=transient,
            policy=policy,
            boot_id=boot_id,
        )

    # -- acquiring ---------------------------------------------------------------

    def acquire(
        self,
        claimant: str,
        mode: Mode,
        token_names: Sequence[str],
        *,
        transient: bool = False,
        policy: Policy = NO_POLICY,
    ) -> ClaimPlan:
        claimant = str(Claimant.parse(claimant))
        tokens = self._resolve_fresh(token_names)
        by_name = {token.name: token for token in tokens}
        # Outside the lock: these may ask libvirt, whose hooks call back in here.
        holders = self.host.holders(tokens)
        boot_id = self.host.boot_id()
        alive = self._liveness(self.ledger.inspect().state, boot_id)
        with self.ledger.transaction() as txn:
            try:
                stranded = self._stranded_unlocked(txn.state, boot_id, alive)
                plan = decide_claim(
                    txn.state,
                    claimant,
                    mode,
                    tokens,
                    holders,
                    stranded,
                    transient=transient,
                    policy=policy,
                    boot_id=boot_id,
                )
            except ArbiterError as refusal:
                self.events.emit(
                    "refused", claimant=claimant, token=",".join(token_names), why=str(refusal)
                )
                raise
            if plan.already_held:
                own = txn.state.lease_of(claimant)
                if own is not None and claimant in stranded:
                    # The claimant is starting again (a VM restarted without its
                    # release hook): its grace period starts over.
                    txn.state = txn.state.with_lease(replace(own, created=now()))
                return plan
            txn.state = self._intent_unlocked(txn.state, plan, boot_id)
        self.events.emit("claim", claimant=claimant, token=",".join(plan.tokens), mode=str(mode))
        crashpoint("acquire.intent")
        try:
            self._stop_holders(claimant, plan)
            self._switch_tokens(claimant, plan, by_name)
        except ArbiterError as error:
            log.error("%s: claim failed, undoing it: %s", claimant, error)
            self.events.emit(
                "failed", claimant=claimant, token=",".join(plan.tokens), why=str(error)
            )
            self._finish_release(claimant, success=False, reason=str(error))
            raise
        for name in plan.cdi_tokens:
            self._regenerate_cdi(by_name[name])
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                # `created` restarts here: claim_grace counts from the moment the
                # claimant may start, not from the intent (stopping holders takes time).
                txn.state = txn.state.with_lease(
                    replace(lease, state=LeaseState.ACTIVE, owner_pid=0, created=now())
                )
        self.events.emit("active", claimant=claimant, token=",".join(plan.tokens), mode=str(mode))
        crashpoint("acquire.active")
        return plan

    def _intent_unlocked(self, state: LedgerState, plan: ClaimPlan, boot_id: str) -> LedgerState:
        for token, home in plan.homes.items():
            if not state.home_of(token):
                state = state.with_home(token, dict(home))
        for preempted in plan.preempted_leases:
            state = state.without_lease(preempted)
        # A holder is recorded once: a stop planned now supersedes an inherited
        # record of it (one whose stop never happened before a crash).
        planned = {step.holder for step in plan.stops}
        stopped = [record for record in plan.inherited if record.holder not in planned]
        # A holder this claim stops is its to bring back, even if an unfinished
        # lease (left by a crash) still lists it as planned.
        for other in state.leases:
            taken = [r for r in other.stopped if r.holder in planned and not r.restored]
            for record in taken:
                other = other.with_stopped(replace(record, restored=True))
            if taken:
                state = state.with_lease(other)
        stopped += [StoppedHolder(s.holder, StepState.PLANNED, s.shared_tokens) for s in plan.stops]
        lease = Lease(
            claimant=plan.claimant,
            mode=plan.mode,
            tokens=plan.tokens,
            state=LeaseState.ACQUIRING,
            transient=plan.transient,
            boot_id=boot_id,
            created=now(),
            owner_pid=self.pid,
            stopped=tuple(stopped),
            switched=tuple(sorted((t, StepState.PLANNED) for t in plan.switched_tokens)),
        )
        return state.with_lease(lease)

    def _stop_holders(self, claimant: str, plan: ClaimPlan) -> None:
        for step in plan.stops:
            self.events.emit("stopping", claimant=claimant, holder=step.holder, how=step.how)
            crashpoint("acquire.stop")
            if self.host.is_running(step.holder):
                log.info("%s: stopping %s (%s)", claimant, step.holder, step.how)
                self.host.stop(step.holder)
            self._record_stop(claimant, step.holder, StepState.DONE)
            self.events.emit("preempted", claimant=claimant, holder=step.holder, how=step.how)

    def _record_stop(self, claimant: str, holder: str, step: StepState) -> None:
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                record = next(r for r in lease.stopped if r.holder == holder)
                txn.state = txn.state.with_lease(lease.with_stopped(replace(record, state=step)))

    def _switch_tokens(self, claimant: str, plan: ClaimPlan, by_name: dict[str, TokenSpec]) -> None:
        for token in plan.switched_tokens:
            targets = {s.address: s.to_driver for s in plan.switches if s.token == token}
            self.events.emit("switching", claimant=claimant, token=token, driver=_drivers(targets))
            crashpoint("acquire.switch")
            self._switch(by_name[token], targets, claimant)
            with self.ledger.transaction() as txn:
                lease = txn.state.lease_of(claimant)
                if lease is not None:
                    txn.state = txn.state.with_lease(lease.with_switch(token, StepState.DONE))

    def _switch(self, token: TokenSpec, targets: dict[str, str], claimant: str) -> None:
        """Switch one token; on failure poison it, so nothing touches it again."""
        started = time.monotonic()
        try:
            self.host.switch(token, targets)
        except SwitchFailed as error:
            self._poison(token.name, str(error), claimant)
            raise
        self.events.emit(
            "switched",
            token=token.name,
            claimant=claimant,
            driver=_drivers(targets),
            seconds=round(time.monotonic() - started, 3),
        )

    def _poison(self, token: str, reason: str, claimant: str) -> None:
        with self.ledger.transaction() as txn:
            txn.state = txn.state.with_poison(token, Poison(reason, now()))
        self.events.emit("poisoned", token=token, claimant=claimant, why=reason)

    def _regenerate_cdi(self, token: TokenSpec) -> None:
        try:
            self.host.regenerate_cdi(token)
        except ArbiterError as error:
            log.warning("%s: could not regenerate the CDI spec: %s", token.name, error)

    # -- releasing ---------------------------------------------------------------

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
        return self._finish_release(claimant, success, reason)

    def _finish_release(self, claimant: str, success: bool, reason: str) -> bool:
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
        tokens = {spec.name: spec for spec in self._known_specs(lease.tokens)}
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
            and _pid_alive(lease.owner_pid)
        )

    def _holder_tokens(self, lease: Lease) -> dict[str, set[str]]:
        """Which tokens each holder the lease stopped uses (for hand-overs)."""
        try:
            holders = self.host.holders(list(self.tokens().values()))
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
            current = {f.address: f.driver for f in self._fresh_functions(token)}
            targets = {
                address: driver
                for address, driver in home.items()
                if current.get(address) == VFIO or (driver and current.get(address) != driver)
            }
            if targets:
                self.events.emit(
                    "switching", claimant=claimant, token=token.name, driver=_drivers(targets)
                )
                crashpoint("release.switch")
                try:
                    self._switch(token, targets, claimant)
                except SwitchFailed as error:
                    log.error("%s: could not return home: %s", token.name, error)
                    return False
            if token.cdi:
                self._regenerate_cdi(token)
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

    # -- restore, status, poison ------------------------------------------------------

    def restore(self, claimants: Sequence[str] | None = None, dry_run: bool = False) -> list[str]:
        """Converge stranded (or named) claimants: restore, send home, remove leases."""
        state = self.ledger.read() if dry_run else self.ledger.recover()
        if claimants is None:
            targets = sorted(self.stranded_claimants(state))
        else:
            targets = [str(Claimant.parse(c)) for c in claimants]
            targets = [c for c in targets if state.lease_of(c) is not None]
        if dry_run:
            return targets
        for claimant in targets:
            self.events.emit("restore", claimant=claimant)
            self._finish_release(claimant, success=False, reason="restored")
        return targets

    def stranded_claimants(self, state: LedgerState) -> frozenset[str]:
        return self._stranded_unlocked(state, self.host.boot_id())

    def _liveness(self, state: LedgerState | None, boot_id: str) -> dict[str, bool]:
        """Whether each active lease's claimant runs, asked before taking the lock."""
        if state is None:
            return {}
        return {
            lease.claimant: self.host.is_running(lease.claimant)
            for lease in state.leases
            if lease.state is LeaseState.ACTIVE and lease.boot_id == boot_id
        }

    def _stranded_unlocked(
        self, state: LedgerState, boot_id: str, alive: dict[str, bool] | None = None
    ) -> frozenset[str]:
        """Leases from an earlier boot, of a dead writer, or of a claimant gone.

        With `alive` (asked before the lock), a claimant it does not know — a
        lease written meanwhile — counts as running: the lock is never held
        across a question to libvirt.
        """
        stranded = set()
        for lease in state.leases:
            if lease.boot_id != boot_id:
                stranded.add(lease.claimant)
            elif lease.state is not LeaseState.ACTIVE:
                if not _pid_alive(lease.owner_pid):
                    stranded.add(lease.claimant)
            elif self._young(lease):
                continue
            elif alive is not None:
                if not alive.get(lease.claimant, True):
                    stranded.add(lease.claimant)
            elif not self.host.is_running(lease.claimant):
                stranded.add(lease.claimant)
        return frozenset(stranded)

    def _young(self, lease: Lease) -> bool:
        """A claimant is allowed to not run yet right after its claim (a VM starting)."""
        try:
            age = time.time() - datetime.fromisoformat(lease.created).timestamp()
        except ValueError:
            return False
        return age < self.config.timeouts.claim_grace

    def status(self) -> Status:
        reading = self.ledger.inspect()
        state = reading.state or LedgerState()
        stranded = self.stranded_claimants(state) if reading.state else frozenset()
        tokens = []
        for spec in self.tokens().values():
            poison = state.poison_of(spec.name)
            holding = [lease for lease in state.leases if blocks_token(lease, spec.name)]
            mode = "unknown" if reading.corrupt else "idle"
            if any(lease.mode is Mode.EXCLUSIVE for lease in holding):
                mode = "exclusive"
            elif holding:
                mode = "shared"
            tokens.append(
                TokenStatus(
                    name=spec.name,
                    address=spec.address,
                    mode=mode,
                    drivers=tuple((f.address, f.driver) for f in self._fresh_functions(spec)),
                    poisoned=poison is not None,
                    reason=poison.reason if poison else "",
                    since=poison.since if poison else "",
                    claimants=tuple(lease.claimant for lease in holding),
                )
            )
        return Status(
            leases=state.leases,
            tokens=tuple(tokens),
            stranded=tuple(sorted(stranded)),
            generation=state.generation,
            corrupt=str(reading.corrupt) if reading.corrupt else None,
        )

    def clear_poison(self, token: str) -> bool:
        with self.ledger.transaction() as txn:
            if txn.state.poison_of(token) is None:
                return False
            txn.state = txn.state.with_poison(token, None)
        self.events.emit("poison-cleared", token=token)
        return True

    # -- helpers --------------------------------------------------------------------

    def _known_specs(self, names: Sequence[str]) -> list[TokenSpec]:
        known = self.tokens()
        return [known[name] for name in names if name in known]

    def _fresh_functions(self, token: TokenSpec) -> Sequence[PciFunction]:
        return self.host.token_functions(token.name, token.address)


def _drivers(targets: dict[str, str]) -> str:
    """The target drivers of a switch, as events name them ("home" for the kernel's choice)."""
    return ",".join(sorted({driver or "home" for driver in targets.values()}))


def _pid_alive(pid: int) -> bool:
    """Whether the process that wrote an in-progress lease still runs."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
