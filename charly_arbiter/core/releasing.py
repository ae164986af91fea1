"""Carrying a release out: the steps of core/release_planner.py's plan, one by one.

Used by `release` (a VM stopped), by `restore` (a stranded lease), by an
acquire that failed half-way (its rollback) and by the hooks' hand-off (`begin`
in the hook, `finish` in the detached process it starts).  Every rule lives in
the planner; this module only reads the host, takes the lock for each small
transaction (deciding and writing in it, on the state read under it), and acts
on the host with the lock let go.  The intent is written first, so a crash at
any point leaves a lease `restore` can finish.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace

from charly_arbiter.core import release_planner as rules
from charly_arbiter.core import sleeplocks
from charly_arbiter.core.crashpoints import crashpoint
from charly_arbiter.core.events import EventKind, Events, drivers_label
from charly_arbiter.core.host import Host, TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.liveness import claimant_runs
from charly_arbiter.core.model import Claimant, LedgerState, ProcessRef, now
from charly_arbiter.core.release_planner import (
    ComebackWay,
    End,
    HomeStep,
    HomeWay,
    ReleasePlan,
    decide_release,
)
from charly_arbiter.core.switching import Switching
from charly_arbiter.core.tokens import TokenCatalogue
from charly_arbiter.errors import ArbiterError, DisplayManagerFailed, SwitchFailed, cli_command

log = logging.getLogger(__name__)


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

    # -- deciding -------------------------------------------------------------------------

    def plan(self, claimant: str, *, force: bool = False) -> ReleasePlan | None:
        """What releasing `claimant` would do, decided over the ledger as it is (read
        without the lock) and the host as it is, changing nothing: `plan --release`.
        With `force`, as `release --force` (the claimant is not asked whether it runs)."""
        ref = Claimant.parse(claimant)
        state = self.ledger.read()
        return decide_release(
            state,
            ref,
            self._tokens_now(),
            me=self.owner,
            boot_id=self.host.boot_id(),
            live_writers=self._live_writers(state, ref),
            claimant_runs=not force and self._runs(state, ref),
            parents=self.tokens.parents(),
        )

    def _runs(self, state: LedgerState, claimant: Claimant) -> bool:
        lease = state.lease_of(claimant)
        return (
            lease is not None
            and rules.may_run_on_it(lease, self.host.boot_id())
            and claimant_runs(self.host, lease)
        )

    def _live_writers(self, state: LedgerState, claimant: Claimant) -> frozenset[ProcessRef]:
        """The writer of the claimant's lease, if it has one and it is alive (a /proc read)."""
        lease = state.lease_of(claimant)
        owner = lease.owner if lease is not None else None
        alive = owner is not None and self.host.process_alive(owner)
        return frozenset({owner}) if alive and owner is not None else frozenset()

    def _tokens_now(self) -> list[TokenSpec]:
        """Every configured token with its functions' drivers as they are now."""
        return [
            replace(spec, functions=tuple(self.tokens.functions_now(spec)))
            for spec in self.tokens.all().values()
        ]

    # -- the release's entry points --------------------------------------------------------

    def release_claimant(
        self, claimant: str, success: bool = True, reason: str = "", *, force: bool = False
    ) -> bool:
        """See `Arbiter.release_claimant`."""
        ref = Claimant.parse(claimant)
        state = self.ledger.read()
        if state.lease_of(ref) is None:
            return False
        # Asked before the lock, since it may be a libvirt call; the planner refuses.
        runs = not force and self._runs(state, ref)
        plan = self._release(ref, success, reason, claimant_runs=runs, announce=True)
        return plan is not None

    def begin(self, claimant: str, success: bool, reason: str) -> ReleasePlan | None:
        """Only the intent: the lease turns releasing, under the lock.

        The hooks do this before they hand the rest to a detached process, so
        that a `prepare` of the same VM right after (destroy, then start) finds
        the lease releasing and waits, instead of finding it active and starting
        the VM without one.  The plan it wrote, or None when there was no lease;
        the rest is `finish(claimant, ..., takeover=<this process>)`, in another
        process or this one, and only where `plan.lease` is not None (a shared
        lease that is not the last on its GPUs ends at the intent).
        """
        ref = Claimant.parse(claimant)
        return self._release(ref, success, reason, announce=True, only_intent=True)

    def finish(
        self, claimant: str, success: bool, reason: str, takeover: ProcessRef | None = None
    ) -> bool:
        """Release the lease to the end.  `takeover` is the process that began this
        release and handed it on (the hook): its lease is continued, not refused."""
        ref = Claimant.parse(claimant)
        return self._release(ref, success, reason, takeover=takeover) is not None

    def _release(
        self,
        claimant: Claimant,
        success: bool,
        reason: str,
        *,
        takeover: ProcessRef | None = None,
        claimant_runs: bool = False,
        announce: bool = False,
        only_intent: bool = False,
    ) -> ReleasePlan | None:
        """Decide under the lock, on the state read under it, and write the intent;
        then (unless `only_intent`) carry it out.  The host facts are read before
        the lock; only the writer's liveness is asked under it (one /proc read).
        None when there is no lease."""
        tokens = self._tokens_now()
        boot_id = self.host.boot_id()
        with self.ledger.transaction() as txn:
            plan = decide_release(
                txn.state,
                claimant,
                tokens,
                me=self.owner,
                boot_id=boot_id,
                live_writers=self._live_writers(txn.state, claimant),
                claimant_runs=claimant_runs,
                takeover=takeover,
                success=success,
                reason=reason,
                parents=self.tokens.parents(),
            )
            if plan is None:
                return None
            txn.state = rules.apply_intent(txn.state, plan)
        if announce:
            self.events.emit(
                EventKind.RELEASE if success else EventKind.FAILED,
                claimant=claimant,
                why=reason or "released",
            )
        crashpoint("release.intent")
        if plan.lease is not None and not only_intent:
            self.carry_out(plan, {spec.name: spec for spec in tokens})
        return plan

    # -- carrying it out --------------------------------------------------------------------

    def carry_out(self, plan: ReleasePlan, tokens: dict[str, TokenSpec]) -> None:
        """Everything after the intent: tokens home, holders back, the lease gone."""
        claimant = plan.claimant
        self._allow_sleep(plan)
        # Each token's way home is recorded before the next one starts; the last one's
        # with the first holder's comeback, which nothing on the host comes between.
        home: str | None = None
        for step in plan.homes:
            if step.due:
                if home is not None:
                    with self.ledger.transaction() as txn:
                        txn.state = rules.apply_home(txn.state, claimant, home)
                home = self._send_home(claimant, step, tokens.get(step.token))
        attempted: set[Claimant] = set()
        while True:
            # The last holder's comeback writes the end with it when nothing else is left.
            end = self._restore_holders(claimant, attempted, home=home)
            home = None
            crashpoint("release.restored")
            if end is None:
                with self.ledger.transaction() as txn:
                    end = rules.decide_end(txn.state, claimant, attempted)
                    txn.state = rules.apply_end(txn.state, claimant, end)
            if end is not End.MORE:
                break
        if end is End.INCOMPLETE:
            log.error(
                "%s: release incomplete; run %s",
                claimant,
                cli_command("restore", operands=[claimant]),
            )

    def _allow_sleep(self, plan: ReleasePlan) -> None:
        """Let go of the lease's sleep locks as its release begins, while its tokens are
        still its own (core/sleeplocks.py), then forget them.  One that cannot be let go
        is logged and stays recorded: `restore` lets go of it."""
        tokens = plan.lease.sleep_locks if plan.lease is not None else ()
        if not tokens:
            return
        crashpoint("release.sleep")
        let_go = []
        for token in tokens:
            try:
                self.host.uninhibit(token)
            except ArbiterError as error:
                log.error(
                    "%s: could not let go of %s's sleep lock: %s", plan.claimant, token, error
                )
                continue
            let_go.append(token)
        with self.ledger.transaction() as txn:
            txn.state = sleeplocks.forgotten(txn.state, let_go, plan.claimant)
        if let_go:
            self.events.emit(
                EventKind.SLEEP_ALLOWED, claimant=plan.claimant, token=",".join(let_go)
            )

    def _send_home(self, claimant: Claimant, step: HomeStep, spec: TokenSpec | None) -> str | None:
        """Send one token home: the token, when its way home is done and is to be recorded
        (the caller records it), or None."""
        if step.way is HomeWay.UNKNOWN or spec is None:
            log.warning("%s: no longer configured, left where it is", step.token)
            return None
        if step.way is HomeWay.POISONED:
            log.warning("%s: poisoned, left where it is", step.token)
        elif step.way is HomeWay.SWITCH:
            targets = step.targets
            self.events.emit(
                EventKind.SWITCHING,
                claimant=claimant,
                token=step.token,
                driver=drivers_label(targets),
            )
            crashpoint("release.switch")
            try:
                self.switching.switch(spec, targets, claimant)  # CDI follows it
            except SwitchFailed as error:
                log.error("%s: could not return home: %s", step.token, error)
                return None
        return step.token

    def _restore_holders(
        self, claimant: Claimant, attempted: set[Claimant], *, home: str | None = None
    ) -> End | None:
        """Bring back, one by one, every holder the lease still records (including
        records handed to it meanwhile), newest first; `attempted` are the ones this
        release has dealt with already.  `home`: a token whose way home is recorded in
        the first transaction, before the first decision.  The lease's end, when the
        last holder's comeback wrote it too (None: the caller decides it)."""
        while True:
            with self.ledger.transaction() as txn:
                if home is not None:
                    txn.state = rules.apply_home(txn.state, claimant, home)
                    home = None
                comeback = rules.decide_comeback(txn.state, claimant, attempted)
                if comeback is None:
                    return None
                txn.state = rules.apply_comeback(txn.state, comeback)
            attempted.add(comeback.record.holder)
            holder = comeback.record.holder
            if comeback.way is ComebackWay.WAIT:
                log.warning("%s: %s stays stopped: %s", claimant, holder, comeback.why)
                continue
            if comeback.way is ComebackWay.ENDED:
                self._ended(claimant, holder)
                continue
            if comeback.way is not ComebackWay.START:
                log.info("%s: %s stays stopped for %s", claimant, holder, comeback.to)
                continue
            crashpoint("release.start")
            try:
                self._start(claimant, holder)
            except ArbiterError as error:
                log.error("%s: could not restore %s: %s", claimant, holder, error)
                screen = {}
                if isinstance(error, DisplayManagerFailed):
                    # What went wrong, and where the person in front of it can log in.
                    screen = {"journal": "\n".join(error.journal), "console": error.console or ""}
                self.events.emit(
                    EventKind.RESTORE_FAILED,
                    claimant=claimant,
                    holder=holder,
                    why=str(error),
                    **screen,
                )
                with self.ledger.transaction() as txn:
                    txn.state = rules.apply_start_failed(txn.state, comeback)
                continue
            end = self._came_back(comeback, attempted)
            if end is not None:
                return end

    def _ended(self, claimant: Claimant, holder: Claimant) -> None:
        """A session's record, dealt with: it runs still (the claim stopped half-way
        before it), or it ended for good and says so."""
        if self.host.is_running(holder):
            self.events.emit(EventKind.RESTORED, claimant=claimant, holder=holder)
            return
        log.info("%s: %s is not started again: a session cannot be", claimant, holder)
        self.events.emit(EventKind.SESSION_ENDED, claimant=claimant, holder=holder)

    def _start(self, claimant: Claimant, holder: Claimant) -> None:
        # A planned stop may have happened just before a crash: whatever is not
        # running now was running when the claim was decided.
        if not self.host.is_running(holder):
            log.info("%s: starting %s again", claimant, holder)
            self.events.emit(EventKind.STARTING, claimant=claimant, holder=holder)
            self.host.start(holder)
            if not self.host.is_running(holder):
                log.warning(
                    "%s: %s cannot be started again (a terminated process)", claimant, holder
                )
        self.events.emit(EventKind.RESTORED, claimant=claimant, holder=holder)

    def _came_back(self, comeback: rules.Comeback, attempted: set[Claimant]) -> End | None:
        """Mark it restored and, for a preempted shared claimant, give its lease back
        where the planner says (the host read first, the decision under the lock).
        When no other holder is left to bring back (`attempted`: those dealt with),
        the same write ends the lease: its end, or None."""
        end = None
        record = comeback.record
        running = bool(record.shared_tokens) and self.host.is_running(record.holder)
        home = _home_tokens(self.tokens, record.shared_tokens) if running else frozenset()
        boot_id = self.host.boot_id()
        with self.ledger.transaction() as txn:
            returned = rules.decide_return(
                txn.state,
                comeback.lease,
                record,
                running=running,
                home=home,
                parents=self.tokens.parents(),
            )
            txn.state = rules.apply_return(
                txn.state, comeback, returned, boot_id=boot_id, created=now()
            )
            if rules.decide_comeback(txn.state, comeback.lease, attempted) is None:
                end = rules.decide_end(txn.state, comeback.lease, attempted)
                txn.state = rules.apply_end(txn.state, comeback.lease, end)
        if returned.taken:
            log.error(
                "%s: %s gets no shared lease back: %s held exclusively meanwhile",
                comeback.lease,
                record.holder,
                ", ".join(returned.taken),
            )
        return end


def _home_tokens(tokens: TokenCatalogue, names: Collection[str]) -> frozenset[str]:
    """Which of the named tokens have every function off vfio-pci now."""
    return frozenset(
        spec.name
        for spec in tokens.known(list(names))
        if rules.home_now(replace(spec, functions=tuple(tokens.functions_now(spec))))
    )
