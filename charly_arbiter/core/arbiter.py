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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from charly_arbiter.core import sleeplocks
from charly_arbiter.core.config import Config
from charly_arbiter.core.crashpoints import crashpoint
from charly_arbiter.core.events import EventKind, Events, drivers_label
from charly_arbiter.core.host import Blocker, DeviceUser, Holder, Host, ScreenUse, TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.liveness import (
    claimant_liveness,
    claimant_runs,
    not_running_yet,
    stranded_claimants,
)
from charly_arbiter.core.model import (
    VFIO,
    Claimant,
    HolderKind,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    ProcessRef,
    StepState,
    StoppedHolder,
    blocks_token,
    now,
)
from charly_arbiter.core.planner import (
    NO_POLICY,
    ClaimPlan,
    Policy,
    decide_claim,
    unaccounted,
    unaccounted_hint,
)
from charly_arbiter.core.release_planner import ReleasePlan, may_run_on_it
from charly_arbiter.core.releasing import Releaser
from charly_arbiter.core.sleeplocks import SleepLockPlan
from charly_arbiter.core.switching import Switching
from charly_arbiter.core.tokens import TokenCatalogue, vf_specs
from charly_arbiter.errors import (
    ArbiterError,
    ClaimantRunning,
    ClaimRefused,
    LedgerContradicted,
    TokenUnaccounted,
    cli_command,
)

log = logging.getLogger(__name__)

RETRY_INTERVAL = 0.1  # seconds between tries of a claim that waits for a release


@dataclass(frozen=True)
class TokenStatus:
    name: str
    address: str
    # exclusive, shared, releasing (home, bringing back what it stopped), idle,
    # in-use (no lease, but a holder runs on it that no claim may stop), unaccounted
    # (on vfio-pci, and nothing in the ledger says why), unknown (corrupt ledger)
    mode: str
    drivers: tuple[tuple[str, str | None], ...]
    poisoned: bool
    reason: str
    since: str
    claimants: tuple[str, ...]
    # Running holders that use it without a lease on it (a unit, a container, a VM).
    users: tuple[Holder, ...] = ()
    unaccounted: tuple[str, ...] = ()  # its functions on vfio-pci that nothing accounts for
    bound_by_admin: bool = False  # its home is vfio-pci (`adopt --admin`)
    # SR-IOV: a physical function's VFs now (and how many it can have), a virtual
    # function's PF (and whether the VF exists now).
    virtual_functions: tuple[str, ...] = ()
    total_vfs: int | None = None
    physical_function: str | None = None
    absent: bool = False


@dataclass(frozen=True)
class SleepStatus:
    """The host's sleep locks (core/sleeplocks.py) as `status` shows them."""

    policy: str = "block"  # `sleep`: block or allow
    locks: tuple[tuple[str, str], ...] = ()  # (token, why): the locks the host holds now
    # tokens of active exclusive leases that need a lock and have none (the host could
    # not take it, or it was stopped from outside: `restore` takes it again)
    missing: tuple[str, ...] = ()
    unavailable: str = ""  # why this host cannot hold a lock at all (no systemd)

    def lock_of(self, token: str) -> str | None:
        """What the token's lock says, if the host holds one."""
        return dict(self.locks).get(token)


@dataclass(frozen=True)
class Status:
    leases: tuple[Lease, ...]
    tokens: tuple[TokenStatus, ...]
    stranded: tuple[str, ...]
    generation: int
    corrupt: str | None = None
    boot_id: str = ""  # the host's boot, against which leases are judged stranded
    # The highest generation the history recorded, when the ledger is behind it (it
    # was deleted or replaced by an older or an empty one); None when it is not.
    history_generation: int | None = None
    sleep: SleepStatus = SleepStatus()


def rollback_found(generation: int, recorded: int) -> str:
    """What a ledger behind the history means, in one clause (status, doctor, refusals)."""
    return (
        f"the ledger is at generation {generation}, but the history recorded generation "
        f"{recorded}: it was deleted or replaced, and the leases it held may be lost"
    )


class Arbiter:
    def __init__(
        self,
        config: Config,
        host: Host,
        ledger: Ledger,
        events: Events | None = None,
        owner: ProcessRef | None = None,
        generation_floor: Callable[[], int] | None = None,
        tokens: TokenCatalogue | None = None,
    ) -> None:
        self.config = config
        self.host = host
        self.ledger = ledger
        self.events = events or Events()
        # Every event says which ledger generation its process saw last, so that a
        # ledger that went backwards (deleted, replaced) shows against the history.
        self.events.context.setdefault("generation", lambda: ledger.generation_seen)
        # The highest generation the history recorded (`compose` reads it from the
        # history's tail); None where there is no history to hold the ledger to.
        self.generation_floor = generation_floor
        # Written into in-progress leases; `restore` treats them as stranded
        # once this very process (pid and start time) is gone.
        self.owner = owner or host.current_process()
        # (a hook may have read them already, from the PCI side alone)
        self.tokens = tokens or TokenCatalogue(config, host)
        self.switching = Switching(host, ledger, self.events)

    def releaser(self) -> Releaser:
        """The release steps, over this arbiter's ledger, host, tokens and identity."""
        return Releaser(
            self.ledger, self.host, self.events, self.tokens, self.switching, self.owner
        )

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
        """Decide a claim against the live host and ledger, changing nothing (not even
        the history: a ledger that went backwards is refused as `acquire` would be,
        without recording it)."""
        ref = Claimant.parse(claimant)
        tokens = self.tokens.reread(token_names)
        self._refuse_rollback(record=False)
        holders = self.host.holders(tokens)
        state = self.ledger.read()
        boot_id = self.host.boot_id()
        return decide_claim(
            state,
            ref,
            mode,
            tokens,
            holders,
            self._stranded_unlocked(state, boot_id),
            transient=transient,
            policy=policy,
            boot_id=boot_id,
            blockers=self._blockers(mode, tokens),
            coverage=self.tokens.addresses(),
            parents=self.tokens.parents(),
            vf_users=self._vf_users(mode, tokens),
            screens=self._screens(mode, tokens),
        )

    def plan_release(self, claimant: str, *, force: bool = False) -> ReleasePlan | None:
        """Decide a release against the live host and ledger, changing nothing (None:
        the claimant holds no lease).  Raises the refusal the release would meet."""
        return self.releaser().plan(claimant, force=force)

    def _blockers(self, mode: Mode, tokens: Sequence[TokenSpec]) -> dict[str, Blocker]:
        if mode is not Mode.EXCLUSIVE:
            return {}
        found = {token.name: self.host.passthrough_blocker(token) for token in tokens}
        return {name: blocker for name, blocker in found.items() if blocker is not None}

    def _screens(self, mode: Mode, tokens: Sequence[TokenSpec]) -> dict[str, ScreenUse]:
        """Who uses each token's screen, for an exclusive claim (read outside the lock,
        as the holders are: what it depends on, the display manager running and the
        GPU on its driver, is what `_refuse_if_holders_came_back` and
        `_refuse_if_drivers_moved` check again under it)."""
        if mode is not Mode.EXCLUSIVE:
            return {}
        return {token.name: self.host.screen(token) for token in tokens if not token.absent}

    def _vf_users(self, mode: Mode, tokens: Sequence[TokenSpec]) -> list[DeviceUser]:
        """Who has a node of the tokens' virtual functions open (a VM's /dev/vfio/N, a
        DRM node): an exclusive claim on their physical function names them."""
        if mode is not Mode.EXCLUSIVE:
            return []
        vfs = [vf for token in tokens for vf in token.virtual_functions]
        return list(self.host.device_users(vf_specs(self.host, vfs)))

    # -- acquiring ---------------------------------------------------------------

    def acquire(
        self,
        claimant: str,
        mode: Mode,
        token_names: Sequence[str],
        *,
        transient: bool = False,
        policy: Policy = NO_POLICY,
        wait: float | None = None,
        in_place: bool = False,
    ) -> ClaimPlan:
        """Claim the tokens, stopping what must make room, or raise why not.

        A refusal that an operation under way will lift (this claimant's
        previous lease still being released, a holder being started again) is
        retried for up to `wait` seconds (default `timeouts.claim_wait`): a VM
        destroyed and started at once waits for its own release instead of
        being refused or, worse, finding its old lease and starting without one.

        A token name `TOKEN:N` is the MIG instance N of TOKEN's GPU (a sub-token, as
        NVIDIA's CDI spec names it `GPU:N`): it is claimed shared, as a use of the GPU.
        `in_place` (the arbiter's own MIG change) stops what uses the tokens and
        switches nothing.
        """
        ref = Claimant.parse(claimant)
        token_names = self.tokens.parent_names(token_names, mode, self.host.mig)
        limit = self.config.timeouts.claim_wait if wait is None else wait
        deadline = time.monotonic() + limit
        tokens = self.tokens.reread(token_names)
        self._refuse_rollback()
        while True:
            try:
                return self._acquire_once(ref, mode, tokens, transient, policy, in_place)
            except ClaimRefused as refusal:
                if not refusal.retry or time.monotonic() >= deadline:
                    if isinstance(refusal, TokenUnaccounted):
                        self.events.emit(EventKind.MISMATCH, token=refusal.token, found=refusal.why)
                    self.events.emit(
                        EventKind.REFUSED,
                        claimant=ref,
                        token=",".join(token_names),
                        why=str(refusal),
                    )
                    raise
                log.info("%s: %s; waiting", ref, refusal.why)
            time.sleep(RETRY_INTERVAL)
            tokens = self.tokens.reread(token_names)  # drivers may have moved meanwhile

    def _acquire_once(
        self,
        claimant: Claimant,
        mode: Mode,
        tokens: Sequence[TokenSpec],
        transient: bool,
        policy: Policy,
        in_place: bool = False,
    ) -> ClaimPlan:
        by_name = {token.name: token for token in tokens}
        # Outside the lock: these may ask libvirt, whose hooks call back in here.
        seen = self.ledger.read()
        holders = self.host.holders(tokens)
        blockers = {} if in_place else self._blockers(mode, tokens)
        screens = {} if in_place else self._screens(mode, tokens)
        vf_users = self._vf_users(mode, tokens)
        boot_id = self.host.boot_id()
        alive = claimant_liveness(self.host, seen, boot_id)
        with self.ledger.transaction() as txn:
            _refuse_if_holders_came_back(seen, txn.state, holders, claimant, tokens)
            stranded = self._stranded_unlocked(txn.state, boot_id, alive)
            self._refuse_if_drivers_moved(txn.state, claimant, tokens)
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
                blockers=blockers,
                coverage=self.tokens.addresses(),
                parents=self.tokens.parents(),
                vf_users=vf_users,
                in_place=in_place,
                screens=screens,
            )
            if plan.already_held:
                own = txn.state.lease_of(claimant)
                if own is not None and claimant in stranded:
                    # The claimant is starting again (a VM restarted without its
                    # release hook): its grace period starts over.
                    txn.state = txn.state.with_lease(replace(own, created=now()))
                return plan
            txn.state = self._intent_unlocked(txn.state, plan, boot_id)
        self.events.emit(
            EventKind.CLAIM, claimant=claimant, token=",".join(plan.tokens), mode=str(mode)
        )
        crashpoint("acquire.intent")
        sleeps = sleeplocks.blocks_sleep(plan.mode, claimant, self.config.sleep)
        try:
            self._stop_holders(claimant, plan)
            # The last switch's record also records the sleep locks (one write less).
            recorded = self._switch_tokens(claimant, plan, by_name, record_sleep=sleeps)
        except Exception as error:
            # Any failure after the first side effect is undone, not only the
            # arbiter's own errors: a holder must never stay stopped for nothing.
            log.error("%s: claim failed, undoing it: %s", claimant, error)
            self.events.emit(
                EventKind.FAILED, claimant=claimant, token=",".join(plan.tokens), why=str(error)
            )
            try:
                self.releaser().finish(claimant, success=False, reason=str(error))
            except ArbiterError as undo_error:
                log.error("%s: undoing the claim failed too: %s", claimant, undo_error)
            raise
        for name in plan.cdi_tokens:
            if name not in plan.switched_tokens:  # a switch refreshed it already
                self.switching.regenerate_cdi(by_name[name])
        if sleeps:
            self._block_sleep(claimant, plan, recorded=recorded)
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                # `created` restarts here: claim_grace counts from the moment the
                # claimant may start, not from the intent (stopping holders takes time).
                # The arbiter's own operation keeps its writer: it is its claimant.
                owner = self.owner if lease.is_operation else None
                txn.state = txn.state.with_lease(
                    replace(lease, state=LeaseState.ACTIVE, created=now()).owned_by(owner)
                )
        self.events.emit(
            EventKind.ACTIVE, claimant=claimant, token=",".join(plan.tokens), mode=str(mode)
        )
        crashpoint("acquire.active")
        return plan

    def _refuse_if_drivers_moved(
        self, state: LedgerState, claimant: Claimant, tokens: Sequence[TokenSpec]
    ) -> None:
        """Retry a claim whose drivers, read before the lock, say "on vfio-pci with no
        lease" while they say otherwise now: a release that finished in between sent
        the GPU home and then gave its lease back (a VM destroyed and started at once).
        Under the lock no release moves them, so the second reading is the truth; a
        token still on vfio-pci with nothing to account for it is refused by the
        planner as before."""
        for token in tokens:
            if not unaccounted(state, token):
                continue
            now_spec = replace(token, functions=tuple(self.tokens.functions_now(token)))
            if not unaccounted(state, now_spec):
                raise ClaimRefused(
                    token.name, str(claimant), "its drivers moved while it was read", retry=True
                )

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
        # A holder this claim stops, or takes over from a releasing lease, is its
        # to bring back: no other lease may still list it.
        taken_over = set(plan.taken_over)
        for other in state.leases:
            taken = [
                r
                for r in other.unrestored()
                if r.holder in planned or (other.claimant, r.holder) in taken_over
            ]
            for record in taken:
                other = other.with_stopped(replace(record, restored=True))
            if taken:
                state = state.with_lease(other)
        stopped += [
            StoppedHolder(s.holder, StepState.PLANNED, s.shared_tokens, tokens=s.tokens)
            for s in plan.stops
        ]
        lease = Lease(
            claimant=plan.claimant,
            mode=plan.mode,
            tokens=plan.tokens,
            state=LeaseState.ACQUIRING,
            transient=plan.transient,
            boot_id=boot_id,
            created=now(),
            stopped=tuple(stopped),
            switched=tuple(sorted((t, StepState.PLANNED) for t in plan.switched_tokens)),
        ).owned_by(self.owner)
        return state.with_lease(lease)

    def _stop_holders(self, claimant: Claimant, plan: ClaimPlan) -> None:
        self._tell_sessions(claimant, plan)
        for step in plan.stops:
            self.events.emit(
                EventKind.STOPPING, claimant=claimant, holder=step.holder, how=step.how
            )
            crashpoint("acquire.stop")
            if self.host.is_running(step.holder):
                log.info("%s: stopping %s (%s)", claimant, step.holder, step.how)
                self.host.stop(step.holder)
            self._record_stop(claimant, step.holder, StepState.DONE)
            self.events.emit(
                EventKind.PREEMPTED, claimant=claimant, holder=step.holder, how=step.how
            )

    def _tell_sessions(self, claimant: Claimant, plan: ClaimPlan) -> None:
        """Before anything of a screen is stopped: tell the people in its sessions why,
        and give them `timeouts.screen_grace` (their desktop is still up: a shell that
        runs as a user unit goes first)."""
        sessions = [
            step.holder
            for step in plan.stops
            if step.holder.kind is HolderKind.SESSION and self.host.is_running(step.holder)
        ]
        if not sessions:
            return
        grace = self.config.timeouts.screen_grace
        message = (
            f"{', '.join(plan.tokens)} is given to {claimant}: this session ends in "
            f"{grace:g} s. Save your work; the login screen comes back when {claimant} "
            "gives the GPU back."
        )
        for session in sessions:
            self.events.emit(EventKind.TOLD, claimant=claimant, holder=session, seconds=grace)
        self.host.tell(sessions, message)
        time.sleep(grace)

    def _record_stop(self, claimant: Claimant, holder: Claimant, step: StepState) -> None:
        with self.ledger.transaction() as txn:
            lease = txn.state.lease_of(claimant)
            if lease is not None:
                record = next(r for r in lease.stopped if r.holder == holder)
                txn.state = txn.state.with_lease(lease.with_stopped(replace(record, state=step)))

    def _switch_tokens(
        self,
        claimant: Claimant,
        plan: ClaimPlan,
        by_name: dict[str, TokenSpec],
        *,
        record_sleep: bool = False,
    ) -> bool:
        """Switch each token and record it done.  With `record_sleep`, the last record
        also records the claim's sleep locks, which are taken next (nothing is done on
        the host between): whether it did."""
        last = plan.switched_tokens[-1] if plan.switched_tokens else None
        for token in plan.switched_tokens:
            targets = {s.address: s.to_driver for s in plan.switches if s.token == token}
            self.events.emit(
                EventKind.SWITCHING, claimant=claimant, token=token, driver=drivers_label(targets)
            )
            crashpoint("acquire.switch")
            self.switching.switch(by_name[token], targets, claimant)
            with self.ledger.transaction() as txn:
                lease = txn.state.lease_of(claimant)
                if lease is not None:
                    txn.state = txn.state.with_lease(lease.with_switch(token, StepState.DONE))
                    if record_sleep and token == last:
                        txn.state = sleeplocks.with_recorded(txn.state, claimant, plan.tokens)
        return record_sleep and last is not None

    # -- sleep locks (core/sleeplocks.py) ---------------------------------------------

    def _block_sleep(self, claimant: Claimant, plan: ClaimPlan, *, recorded: bool) -> None:
        """Take the claim's sleep locks, its GPUs on vfio-pci and before it turns active,
        each recorded in its lease first (`recorded`: with the last switch already).  A
        host that cannot take them (no systemd) is logged and recorded in the lease,
        never a failed claim: the VM starts all the same, and `status`, `explain` and
        `doctor` say that sleep is not blocked."""
        if not recorded:
            with self.ledger.transaction() as txn:
                txn.state = sleeplocks.with_recorded(txn.state, claimant, plan.tokens)
        crashpoint("acquire.sleep")
        tokens = ",".join(plan.tokens)
        try:
            for token in plan.tokens:
                self.host.inhibit(token, sleeplocks.lock_why(token, claimant))
        except ArbiterError as error:
            log.warning("%s: sleep is not blocked: %s", claimant, error)
            self.events.emit(
                EventKind.SLEEP_LOCK_FAILED, claimant=claimant, token=tokens, why=str(error)
            )
            with self.ledger.transaction() as txn:
                txn.state = sleeplocks.with_failure(txn.state, claimant, str(error))
            return
        self.events.emit(EventKind.SLEEP_BLOCKED, claimant=claimant, token=tokens)

    def converge_sleep_locks(self) -> SleepLockPlan:
        """Bring the host's sleep locks to what the leases need (`restore` ends with it):
        a lock for each token of an active exclusive lease, none other.  The leases a
        live process is carrying out are left to it.  Each lock taken is recorded
        first, each one let go forgotten after; a lock that cannot be taken is
        recorded as such in its lease."""
        held = dict(self.host.inhibitors())
        seen = self.ledger.read()
        busy = frozenset(
            lease.claimant
            for lease in seen.leases
            if lease.owner is not None
            and lease.owner != self.owner
            and self.host.process_alive(lease.owner)
        )
        with self.ledger.transaction() as txn:
            plan = sleeplocks.decide_sleep_locks(txn.state, self.config.sleep, held, busy)
            records = sleeplocks.recorded(txn.state)
            for token, _, owner in plan.take:
                txn.state = sleeplocks.with_recorded(txn.state, owner, [token])
            for token, owner in plan.record:
                txn.state = sleeplocks.with_recorded(txn.state, owner, [token])
        for token in plan.let_go:
            try:
                self.host.uninhibit(token)
            except ArbiterError as error:
                log.error("%s: could not let go of its sleep lock: %s", token, error)
                continue
            whose = {"claimant": records[token]} if token in records else {}
            self.events.emit(EventKind.SLEEP_ALLOWED, token=token, **whose)
        failed: dict[Claimant, str] = {}
        for token, why, owner in plan.take:
            try:
                self.host.inhibit(token, why)
            except ArbiterError as error:
                log.warning("%s: sleep is not blocked: %s", owner, error)
                self.events.emit(
                    EventKind.SLEEP_LOCK_FAILED, claimant=owner, token=token, why=str(error)
                )
                failed[owner] = str(error)
                continue
            self.events.emit(EventKind.SLEEP_BLOCKED, claimant=owner, token=token)
        if plan.let_go or plan.forget or failed:
            with self.ledger.transaction() as txn:
                txn.state = sleeplocks.forgotten(txn.state, {*plan.let_go, *plan.forget})
                for owner, why in failed.items():
                    txn.state = sleeplocks.with_failure(txn.state, owner, why)
        return plan

    # -- releasing ---------------------------------------------------------------

    def release_claimant(
        self,
        claimant: str,
        success: bool = True,
        reason: str = "",
        *,
        force: bool = False,
        stopped: bool = False,
    ) -> bool:
        """Remove the claimant's lease; the last lease on a token sends it home and
        brings back what was stopped for it.  Returns False when there was no lease.

        A claimant that still runs is refused (`ClaimantRunning`) unless `force`:
        its GPU would go home under it.  The hooks pass `force`, since libvirt or
        the runtime has just told them the claimant stopped, and `stopped`: a stop is
        never blocked, not even by a ledger the host contradicts (the claimant's own
        lease, if it has one, is what its GPU was given for).  From an operator, a
        release on such a ledger is refused until the operator has decided.
        Failures restoring holders are logged and leave the lease for `restore`;
        this never raises for them, because it runs when a VM stops.
        """
        if not stopped:
            lease = self.ledger.read().lease_of(Claimant.parse(claimant))
            self.refuse_contradictions(lease.tokens if lease is not None else ())
        return self.releaser().release_claimant(claimant, success, reason, force=force)

    # -- restore, status, poison ------------------------------------------------------

    def restore(
        self, claimants: Sequence[str] | None = None, dry_run: bool = False, *, force: bool = False
    ) -> list[Claimant]:
        """Converge stranded (or named) claimants: restore, send home, remove leases.

        Named claimants whose active lease belongs to a claimant that still runs
        are refused unless `force`; with `--stranded`, such a claimant (one that
        started again meanwhile) is skipped.
        """
        self._refuse_rollback()
        state = self.ledger.read() if dry_run else self.ledger.tidy()
        boot_id = self.host.boot_id()
        if claimants is None:
            targets = sorted(self.stranded_claimants(state))
            running = [c for c in targets if _runs_with_active_lease(self, state, c, boot_id)]
            targets = [c for c in targets if c not in running]
            for claimant in running:
                log.warning("%s: started again meanwhile; its lease is left alone", claimant)
        else:
            targets = [Claimant.parse(c) for c in claimants]
            targets = [c for c in targets if state.lease_of(c) is not None]
            if not force:
                for claimant in targets:
                    if _runs_with_active_lease(self, state, claimant, boot_id):
                        raise ClaimantRunning(claimant, "restoring")
        if dry_run:
            return targets
        leases = [lease for lease in map(state.lease_of, targets) if lease is not None]
        self.refuse_contradictions([token for lease in leases for token in lease.tokens])
        releaser = self.releaser()
        for claimant in targets:
            self.events.emit(EventKind.RESTORE, claimant=claimant)
            releaser.finish(claimant, success=False, reason="restored")
        self.converge_sleep_locks()
        return targets

    def stranded_claimants(self, state: LedgerState) -> frozenset[Claimant]:
        return self._stranded_unlocked(state, self.host.boot_id())

    def not_running_yet(self, state: LedgerState) -> dict[Claimant, float]:
        """Claimants that do not run, claimed less than `timeouts.claim_grace` ago:
        stranded once it has passed (each with its claim's age in seconds)."""
        boot_id = self.host.boot_id()
        return not_running_yet(
            state,
            boot_id,
            grace=self.config.timeouts.claim_grace,
            alive=claimant_liveness(self.host, state, boot_id),
        )

    def _stranded_unlocked(
        self, state: LedgerState, boot_id: str, alive: dict[Claimant, bool] | None = None
    ) -> frozenset[Claimant]:
        if alive is None:
            alive = claimant_liveness(self.host, state, boot_id)
        return stranded_claimants(
            state,
            boot_id,
            grace=self.config.timeouts.claim_grace,
            process_alive=self.host.process_alive,
            alive=alive,
        )

    def status(self) -> Status:
        """Leases, tokens and stranded claimants, and where the host (or the history)
        contradicts the ledger.  Tokens no exclusive lease holds also list the holders
        that run on them without a lease: an idle token is one nothing uses."""
        recorded = self.history_generation()  # (read before the ledger: see _refuse_rollback)
        reading = self.ledger.inspect()
        state = reading.state or LedgerState()
        stranded = self.stranded_claimants(state) if reading.state else frozenset()
        tokens = []
        self.tokens.refresh()  # one read of every token's functions, now
        specs = list(self.tokens.all().values())
        users = self._users(state, specs)
        for spec in specs:
            poison = state.poison_of(spec.name)
            holding = [lease for lease in state.leases if blocks_token(lease, spec.name)]
            lost = unaccounted(state, spec) if reading.state else ()
            using = users.get(spec.name, ())
            mode = "unknown" if reading.corrupt else "idle"
            if any(lease.mode is Mode.EXCLUSIVE for lease in holding):
                mode = "exclusive"
            elif holding:
                mode = "shared"
            elif any(
                lease.state is LeaseState.RELEASING and spec.name in lease.tokens
                for lease in state.leases
            ):
                # Home already, but the release is still bringing back what it stopped.
                mode = "releasing"
            elif lost:
                mode = "unaccounted"
            elif reading.state and any(not holder.preemptible for holder in using):
                mode = "in-use"
            home = state.home_of(spec.name)
            tokens.append(
                TokenStatus(
                    name=spec.name,
                    address=spec.address,
                    mode=mode,
                    drivers=tuple((f.address, f.driver) for f in spec.functions),
                    poisoned=poison is not None,
                    reason=poison.reason if poison else "",
                    since=poison.since if poison else "",
                    claimants=tuple(lease.claimant for lease in holding),
                    users=using,
                    unaccounted=lost,
                    bound_by_admin=bool(home) and all(d == VFIO for d in home.values()),
                    virtual_functions=spec.virtual_functions,
                    total_vfs=next(
                        (f.sriov.total_vfs for f in spec.functions if f.sriov is not None), None
                    ),
                    physical_function=spec.physical_function,
                    absent=spec.absent,
                )
            )
        behind = reading.state is not None and recorded > state.generation
        return Status(
            sleep=self._sleep_status(state),
            leases=state.leases,
            tokens=tuple(tokens),
            stranded=tuple(sorted(stranded)),
            generation=state.generation,
            corrupt=str(reading.corrupt) if reading.corrupt else None,
            boot_id=self.host.boot_id(),
            history_generation=recorded if behind else None,
        )

    def _sleep_status(self, state: LedgerState) -> SleepStatus:
        """The host's sleep locks against what the leases need."""
        unavailable = self.host.sleep_lock_unavailable() or ""
        try:
            held = dict(self.host.inhibitors())
        except ArbiterError as error:
            log.warning("cannot list the sleep locks for status: %s", error)
            held, unavailable = {}, unavailable or str(error)
        need = sleeplocks.wanted(state, self.config.sleep)
        return SleepStatus(
            policy=str(self.config.sleep),
            locks=tuple(sorted(held.items())),
            missing=tuple(sorted(token for token, why in need.items() if held.get(token) != why)),
            unavailable=unavailable,
        )

    def _users(
        self, state: LedgerState, specs: Sequence[TokenSpec]
    ) -> dict[str, tuple[Holder, ...]]:
        """token -> the running holders that use it without a lease on it, for the
        tokens no exclusive lease holds (an exclusive lease stopped its holders)."""
        asked = [
            spec
            for spec in specs
            if not any(
                lease.mode is Mode.EXCLUSIVE and blocks_token(lease, spec.name)
                for lease in state.leases
            )
        ]
        if not asked:
            return {}
        try:
            holders = self.host.holders(asked)
        except ArbiterError as error:
            log.warning("cannot list the holders for status: %s", error)
            return {}
        found: dict[str, list[Holder]] = {}
        for holder in holders:
            if not holder.running:
                continue
            for token in holder.tokens:
                leased = any(
                    token in lease.tokens for lease in state.leases if lease.claimant == holder.ref
                )
                if not leased and all(h.ref != holder.ref for h in found.get(token, [])):
                    found.setdefault(token, []).append(holder)
        return {token: tuple(holders) for token, holders in found.items()}

    # -- where the host contradicts the ledger ----------------------------------------

    def history_generation(self) -> int:
        """The highest ledger generation the history recorded (0 without a history)."""
        return self.generation_floor() if self.generation_floor is not None else 0

    def _refuse_rollback(self, *, record: bool = True) -> None:
        """Refuse (`LedgerContradicted`, exit 3) while the ledger is behind the history.

        The history is read first: every generation it holds was on disk before it
        was recorded, and a ledger only grows, so a ledger read after it that is
        behind it went backwards (deleted, or replaced by an older or empty one)."""
        recorded = self.history_generation()
        if not recorded:
            return
        state = self.ledger.read()
        if recorded > state.generation:
            found = rollback_found(state.generation, recorded)
            if record:
                self.events.emit(EventKind.MISMATCH, found=found)
            raise LedgerContradicted(
                "",
                found,
                hint=f"run {cli_command('recover')} to compare what the history says it "
                "held with the host, then decide",
            )

    def refuse_contradictions(self, token_names: Sequence[str]) -> None:
        """Refuse a mutating command while the ledger went backwards, or while one of
        these tokens is on vfio-pci with nothing in the ledger to say why: only an
        operator decides what the host really holds (`recover`, `adopt`, `send-home`)."""
        self._refuse_rollback()
        if not token_names:
            return
        state = self.ledger.read()
        for spec in self.tokens.known(list(dict.fromkeys(token_names))):
            now_spec = replace(spec, functions=tuple(self.tokens.functions_now(spec)))
            lost = unaccounted(state, now_spec)
            if lost:
                found = (
                    f"{', '.join(lost)} on vfio-pci, and no lease or poison in the ledger "
                    "accounts for it"
                )
                self.events.emit(EventKind.MISMATCH, token=spec.name, found=found)
                raise LedgerContradicted(spec.name, found, unaccounted_hint(spec.name))

    def clear_poison(self, token: str) -> bool:
        """Let claims on `token` again; refused (by the transaction) on a corrupt ledger,
        and while the ledger went backwards."""
        self.refuse_contradictions([token])
        with self.ledger.transaction() as txn:
            if txn.state.poison_of(token) is None:
                return False
            txn.state = txn.state.with_poison(token, None)
        self.events.emit(EventKind.POISON_CLEARED, token=token)
        return True


def _runs_with_active_lease(
    arbiter: Arbiter, state: LedgerState, claimant: Claimant, boot_id: str
) -> bool:
    """Whether `claimant` holds an active lease of this boot and still runs."""
    lease = state.lease_of(claimant)
    return (
        lease is not None and may_run_on_it(lease, boot_id) and claimant_runs(arbiter.host, lease)
    )


def _refuse_if_holders_came_back(
    seen: LedgerState,
    now_state: LedgerState,
    holders: Sequence[Holder],
    claimant: Claimant,
    tokens: Sequence[TokenSpec],
) -> None:
    """A retry when a release brought a holder back after the holders were listed.

    The list is taken outside the lock (it may ask libvirt); a holder that was
    stopped then and has been started since would run unseen beside this claim.
    """
    pending = {r.holder for lease in now_state.leases for r in lease.unrestored()}
    came_back = {
        r.holder for lease in seen.leases for r in lease.unrestored() if r.holder not in pending
    }
    names = {token.name for token in tokens}
    for holder in holders:
        if holder.ref in came_back and not holder.running and names & set(holder.tokens):
            raise ClaimRefused(
                ", ".join(sorted(names)),
                claimant,
                f"{holder.ref} was started again while the claim was being decided",
                hint="try again",
                retry=True,
            )
