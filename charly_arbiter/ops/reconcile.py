"""When the host contradicts the ledger: a token on vfio-pci that nothing accounts for.

That happens when the ledger was deleted, emptied or replaced while a GPU was
passed through (its lease went with it), or when something outside the arbiter
bound the GPU to vfio-pci.  The arbiter refuses to act on such a token (a claim,
a release, a restore, a poison clear) until an operator has decided, with one of:

- `adopt TOKEN CLAIMANT`: CLAIMANT (the VM that runs with it, say) holds it; an
  active exclusive lease is written for it, recording the holders the history says
  its claim stopped, so that its release brings them back;
- `adopt --admin TOKEN`: it is on vfio-pci on purpose (bound there at boot): its
  recorded home becomes vfio-pci, so exclusive claims take it as it is, releases
  leave it there, and shared claims are refused;
- `send-home TOKEN`: nobody should have it: it goes to its home driver and the
  holders the history says were stopped for it are started again.

What the history says (`history.last_holder`) is only a proposal shown to the
operator (`explain`, `recover`, the commands' output); nothing here guesses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.events import EventKind, a_or_an
from charly_arbiter.core.host import TokenSpec
from charly_arbiter.core.model import (
    VFIO,
    Claimant,
    HolderKind,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    StepState,
    StoppedHolder,
    human_time,
    now,
)
from charly_arbiter.core.planner import home_map, unaccounted
from charly_arbiter.errors import ArbiterError, SettleRefused, cli_command
from charly_arbiter.ops.history import LastHolder, Record, last_holder


@dataclass(frozen=True)
class Adopted:
    lease: Lease
    stopped: tuple[Claimant, ...]  # recorded as stopped for it, from the history
    runs: bool  # whether the claimant runs now (a lease of one that does not is stranded)


def bound_by_admin(state: LedgerState, token: str) -> bool:
    home = state.home_of(token)
    return bool(home) and all(driver == VFIO for driver in home.values())


def adopt(arbiter: Arbiter, token: str, claimant: str, history: Sequence[Record]) -> Adopted:
    """Record `claimant` as holding `token` exclusively, as it is on vfio-pci now."""
    ref = Claimant.parse(claimant)
    spec = _unaccounted_spec(arbiter, token)
    stopped = _to_bring_back(arbiter, last_holder(history, token), ref)
    runs = _runs(arbiter, ref)
    boot_id = arbiter.host.boot_id()
    with arbiter.ledger.transaction() as txn:
        state = txn.state
        _refuse_unless_unaccounted(state, spec)
        own = state.lease_of(ref)
        extendable = own is None or (own.mode is Mode.EXCLUSIVE and own.state is LeaseState.ACTIVE)
        if own is not None and not extendable:
            raise SettleRefused(
                token,
                f"{ref} holds {a_or_an(own.mode)} lease on {', '.join(own.tokens)} in state "
                f"{own.state}, which an adoption cannot extend",
                hint=f"run {cli_command('release', operands=[ref])} first",
            )
        records = tuple(
            StoppedHolder(holder, StepState.DONE, tokens=(token,))
            for holder in stopped
            if not _recorded_elsewhere(state, holder)
        )
        if own is None:
            lease = Lease(
                claimant=ref,
                mode=Mode.EXCLUSIVE,
                tokens=(token,),
                state=LeaseState.ACTIVE,
                transient=False,
                boot_id=boot_id,
                created=now(),
                stopped=records,
            )
        else:  # a VM with two GPUs whose lease was lost: one token at a time
            lease = replace(own, tokens=(*own.tokens, token))
            for record in records:
                lease = lease.with_stopped(record)
        if not state.home_of(token):
            state = state.with_home(token, home_map(state, spec))
        txn.state = state.with_lease(lease)
    arbiter.events.emit(
        EventKind.ADOPTED,
        token=token,
        claimant=ref,
        stopped=", ".join(record.holder for record in records),
    )
    # Its sleep lock, held still (the ledger was lost, not the host's lock) or taken now.
    arbiter.converge_sleep_locks()
    return Adopted(lease, tuple(record.holder for record in records), runs)


def adopt_admin(arbiter: Arbiter, token: str) -> None:
    """Record vfio-pci as the home of every function of `token`: bound there on purpose."""
    spec = _unaccounted_spec(arbiter, token)
    elsewhere = [f.address for f in spec.functions if f.driver != VFIO]
    if elsewhere:
        raise SettleRefused(
            token,
            f"only part of it is on vfio-pci ({', '.join(elsewhere)} is not), and a token "
            "moves as a whole",
            hint=f"bind every function of its IOMMU group to vfio-pci first, or run "
            f"{cli_command('send-home', operands=[token])}",
        )
    with arbiter.ledger.transaction() as txn:
        _refuse_unless_unaccounted(txn.state, spec)
        txn.state = txn.state.with_home(token, {f.address: VFIO for f in spec.functions})
    arbiter.events.emit(EventKind.ADOPTED, token=token, by="administrator")


def send_home(
    arbiter: Arbiter, token: str, history: Sequence[Record], *, force: bool = False
) -> tuple[Claimant, tuple[Claimant, ...]]:
    """Send `token` home and start again what the history says was stopped for it.

    The command's own process takes the token with a lease (`process:PID`) that
    is releasing from the start, so that nothing claims it meanwhile and a crash
    half-way leaves a stranded lease `restore --stranded` finishes.  Refused while
    the history's last holder of the token still runs (it would lose its GPU from
    under it), unless `force`.  Returns the claimant used and the holders started."""
    arbiter.refuse_contradictions(())  # the ledger-wide check only: this token is the point
    spec = arbiter.tokens.reread([token])[0]
    _refuse_unless_sendable(arbiter.ledger.read(), spec)
    story = last_holder(history, token)
    if story is not None and not force and _runs(arbiter, Claimant.parse(story.claimant)):
        raise SettleRefused(
            token,
            f"the history says {story.claimant} holds it (claimed at "
            f"{human_time(story.since)}), and {story.claimant} runs: sending it home now "
            "would take the GPU from under it",
            hint=f"run {cli_command('adopt', operands=[token, story.claimant])} instead, or stop "
            f"{story.claimant} first (add --force if it does not use the GPU)",
        )
    me = Claimant.of(HolderKind.PROCESS, str(arbiter.owner.pid))
    stopped = _to_bring_back(arbiter, story, me)
    with arbiter.ledger.transaction() as txn:
        state = txn.state
        _refuse_unless_sendable(state, spec)
        if bound_by_admin(state, token):
            state = state.without_home(token)
        records = tuple(
            StoppedHolder(holder, StepState.DONE, tokens=(token,))
            for holder in stopped
            if not _recorded_elsewhere(state, holder)
        )
        lease = Lease(
            claimant=me,
            mode=Mode.EXCLUSIVE,
            tokens=(token,),
            state=LeaseState.RELEASING,
            transient=True,
            boot_id=arbiter.host.boot_id(),
            created=now(),
            stopped=records,
            switched=((token, StepState.PLANNED),),
            note="sent home by an operator",
        ).owned_by(arbiter.owner)
        txn.state = state.with_lease(lease)
    arbiter.events.emit(EventKind.SEND_HOME, claimant=me, token=token)
    # (Written releasing, by this process: the release continues it, as a hook's
    # detached finish continues the hook's.)
    arbiter.releaser().finish(me, True, "sent home", takeover=arbiter.owner)
    arbiter.converge_sleep_locks()  # a lock the lost lease held goes with it
    left = arbiter.ledger.read().lease_of(me)
    if left is not None:
        raise ArbiterError(
            f"{token} did not go all the way home (see the messages above); the lease of "
            f"{me} is kept",
            hint=f"fix the cause, then run {cli_command('restore', operands=[me])}",
        )
    return me, tuple(record.holder for record in records)


def _unaccounted_spec(arbiter: Arbiter, token: str) -> TokenSpec:
    """The token, read now, once the ledger-wide check passed and it is unaccounted."""
    arbiter.refuse_contradictions(())
    spec = arbiter.tokens.reread([token])[0]
    _refuse_unless_unaccounted(arbiter.ledger.read(), spec)
    return spec


def _refuse_unless_sendable(state: LedgerState, spec: TokenSpec) -> None:
    """Sent home: a token nothing accounts for, or one bound to vfio-pci on purpose
    that no lease holds (the administrator changed their mind)."""
    if (
        bound_by_admin(state, spec.name)
        and not state.leases_on(spec.name)
        and state.poison_of(spec.name) is None
    ):
        return
    _refuse_unless_unaccounted(state, spec)


def _refuse_unless_unaccounted(state: LedgerState, spec: TokenSpec) -> None:
    if unaccounted(state, spec):
        return
    held = [lease.claimant for lease in state.leases_on(spec.name)]
    if state.poison_of(spec.name) is not None:
        why = "it is poisoned"
    elif held:
        why = f"the ledger has a lease of {', '.join(held)} on it"
    elif bound_by_admin(state, spec.name):
        why = "it is bound to vfio-pci by the administrator already"
    else:
        why = "it is not on vfio-pci"
    raise SettleRefused(
        spec.name,
        f"{why}; only a token on vfio-pci that nothing in the ledger accounts for is "
        "adopted or sent home",
        hint=f"run {cli_command('explain', operands=[spec.name])}",
    )


def _to_bring_back(
    arbiter: Arbiter, story: LastHolder | None, claimant: Claimant
) -> tuple[Claimant, ...]:
    """The holders the history says the lost claim stopped that do not run now."""
    if story is None:
        return ()
    found = []
    for name in story.stopped:
        try:
            holder = Claimant.parse(name)
        except ArbiterError:
            continue
        if holder != claimant and not _runs(arbiter, holder):
            found.append(holder)
    return tuple(found)


def _recorded_elsewhere(state: LedgerState, holder: Claimant) -> bool:
    """Whether a lease already records the holder as stopped (I3: exactly one does)."""
    return any(record.holder == holder for lease in state.leases for record in lease.unrestored())


def _runs(arbiter: Arbiter, ref: Claimant) -> bool:
    try:
        return arbiter.host.is_running(ref)
    except ArbiterError:
        return False
