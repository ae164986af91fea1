"""The rules of a release, as pure functions from the ledger (and a few host facts) to a plan.

A release ends a lease: when a VM stops (`release`), when a lease is stranded
(`restore`), when an acquire fails half-way (its rollback).  It sends the
lease's GPUs home and brings back what the lease stopped.  Every decision it
makes is here, over frozen values; core/releasing.py only carries them out,
in small ledger transactions, never holding the lock while the host is busy.
Read this module top to bottom, in the order a release goes:

1. `decide_release`: may the lease be released now (a claimant that still
   runs, a lease another live process is carrying out), and the intent:
   which stopped holders' records move to a shared lease that stays, which
   tokens go home and to which drivers, what the lease becomes.
2. `decide_home`: one token's way home, with the drivers read just before.
3. `decide_comeback`: one stopped holder at a time, under the lock, with
   the ledger as it is then: started now, handed to the exclusive lease that
   now holds its GPU, left to another lease that stopped it too, or kept
   stopped while its GPU is not home.
4. `decide_return`: once it runs again, the shared lease a preempted shared
   claimant gets back (and on which tokens).
5. `decide_end`: whether the lease is done, has records handed to it meanwhile,
   or stays for `restore`.

`decide_release` also runs steps 2-5 over the state its intent leads to
(`project`), assuming nothing else happens meanwhile and every step succeeds:
that is what `plan --release` shows.  The release itself decides steps 3-5
again as it goes, since another claim may take a GPU in between.

Each `decide_*` has an `apply_*` beside it: what the decision writes into the
ledger, so the release and its projection write the same thing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from charly_arbiter.core.host import TokenSpec
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
)
from charly_arbiter.core.planner import Switch, home_map
from charly_arbiter.errors import ClaimantRunning, LeaseInProgress

# -- 1. may it be released, and the intent ------------------------------------------------


def may_run_on_it(lease: Lease, boot_id: str) -> bool:
    """Whether the lease's claimant can be running on its GPU: only an active lease
    of this boot (the question is asked of the host only then; it may be a libvirt
    call, never asked under the ledger lock)."""
    return lease.state is LeaseState.ACTIVE and lease.boot_id == boot_id


def refuse_release(
    lease: Lease,
    *,
    me: ProcessRef,
    boot_id: str,
    live_writers: Collection[ProcessRef],
    claimant_runs: bool = False,
    doing: str = "releasing",
) -> None:
    """Raise why the lease may not be released now, if it may not.

    A claimant that still runs would have its GPU sent home under it (on a real
    host the unbind blocks, and the GPU is poisoned): `ClaimantRunning`, unless
    the caller knows better (`--force`, or a hook libvirt has just told that the
    domain stopped: those pass `claimant_runs=False` without asking).

    A lease another live process is acquiring or releasing is left to it:
    tearing it down would race with its steps, and it finishes (or rolls back)
    by itself: `LeaseInProgress`.  Its writer is known by pid and start time
    (`live_writers`), so a zombie or a reused pid never passes for it; a lease
    from an earlier boot has no live writer whatever its pid says.
    """
    if claimant_runs and may_run_on_it(lease, boot_id):
        raise ClaimantRunning(lease.claimant, doing)
    owner = lease.owner
    if (
        lease.state is not LeaseState.ACTIVE
        and owner is not None
        and owner != me
        and lease.boot_id == boot_id
        and owner in live_writers
    ):
        raise LeaseInProgress(lease.claimant, str(lease.state), owner.pid)


@dataclass(frozen=True)
class Handover:
    """At the intent: a record of a holder the released shared lease stopped moves
    to `heir`, a shared lease that stays on the holder's GPU."""

    record: StoppedHolder
    heir: Claimant


class HomeWay(StrEnum):
    """What happens to one token of the released lease."""

    SWITCH = "switch"  # its functions go back to their home drivers
    HOME = "home"  # already there: the step is only recorded
    POISONED = "poisoned"  # left where it is for an operator; the lease lets go of it
    UNKNOWN = "unknown"  # no longer configured: left, and the lease kept for `restore`
    SHARED = "shared"  # another lease still uses it: nothing moves
    UNTOUCHED = "untouched"  # the failed acquire never switched it: not ours to move
    GONE_HOME = "gone home"  # an earlier attempt of this release sent it home


DUE = frozenset({HomeWay.SWITCH, HomeWay.HOME, HomeWay.POISONED, HomeWay.UNKNOWN})


@dataclass(frozen=True)
class HomeStep:
    token: str
    way: HomeWay
    switches: tuple[Switch, ...] = ()  # for SWITCH: each function that moves

    @property
    def due(self) -> bool:
        """Whether the release still has to act (its step in the lease is PLANNED)."""
        return self.way in DUE

    @property
    def targets(self) -> dict[str, str]:
        return {switch.address: switch.to_driver for switch in self.switches}


class ComebackWay(StrEnum):
    """What happens to one stopped holder (see `decide_comeback`)."""

    START = "start"
    HAND = "hand"
    LEFT = "left"
    WAIT = "wait"
    ENDED = "ended"  # a logind session: never started again (see decide_comeback)


@dataclass(frozen=True)
class Comeback:
    """One stopped holder's way back, decided under the lock.

    `record` is as it is written (STARTING while it is started); `to` is the
    lease that brings it back instead (HAND, LEFT); `why` says it for the log
    and for `plan --release`."""

    lease: Claimant
    record: StoppedHolder
    way: ComebackWay
    to: Claimant | None = None
    why: str = ""


@dataclass(frozen=True)
class Return:
    """After a preempted shared claimant came back: the shared lease it gets back.

    `tokens` empty: none, because it does not run, it had none, none of its
    tokens is home, it claimed again by itself meanwhile (`own_lease`), or an
    exclusive lease took one of them meanwhile (`taken`, said loudly)."""

    holder: Claimant
    tokens: tuple[str, ...]
    taken: tuple[str, ...] = ()
    own_lease: bool = False


class End(StrEnum):
    """Where a release stands once it has dealt with every record it knew of."""

    GONE = "gone"  # no lease any more (nothing to do)
    MORE = "more"  # records were handed to it meanwhile: bring those back too
    DONE = "done"  # every token home, every holder back: the lease goes
    INCOMPLETE = "incomplete"  # something did not come back: kept, writer-less, for `restore`


@dataclass(frozen=True)
class ReleasePlan:
    """Everything a release will do, decided before anything is done.

    `lease` is what the released lease becomes at the intent: releasing and
    owned by the releasing process, or None when it ends at once (a shared
    lease that is not the last on any of its GPUs and handed on all it had
    stopped).  `handovers` are written with it.  `homes` says, for each of its
    tokens, whether and how it goes home.  `comebacks`, `returns` and `end` are
    the projection: what the rest of the release does if nothing else changes
    meanwhile and every switch and start succeeds.
    """

    claimant: Claimant
    before: Lease
    lease: Lease | None
    handovers: tuple[Handover, ...] = ()
    homes: tuple[HomeStep, ...] = ()
    comebacks: tuple[Comeback, ...] = ()
    returns: tuple[Return, ...] = ()
    end: End = End.DONE
    continued: bool = False  # takes over a release its hook began (no new intent)


def decide_release(
    state: LedgerState,
    claimant: Claimant,
    tokens: Sequence[TokenSpec],
    *,
    me: ProcessRef,
    boot_id: str,
    live_writers: Collection[ProcessRef] = (),
    claimant_runs: bool = False,
    takeover: ProcessRef | None = None,
    success: bool = True,
    reason: str = "",
    parents: Mapping[str, str] | None = None,
) -> ReleasePlan | None:
    """Decide the release of `claimant`'s lease, or raise why it may not be had.

    None when it holds no lease.  `tokens` are the tokens the release may touch,
    with their functions' current drivers (those missing are no longer
    configured).  `me` is the releasing process, written as the lease's writer.

    `takeover` is the process that began this release and handed the rest on
    (a hook's detached finish): a releasing lease it still owns is continued
    as it stands, neither refused nor decided again.
    """
    lease = state.lease_of(claimant)
    if lease is None:
        return None
    if takeover is not None and lease.state is LeaseState.RELEASING and lease.owner == takeover:
        releasing: Lease | None = lease.owned_by(me)
        handovers: tuple[Handover, ...] = ()
        continued = True
    else:
        refuse_release(
            lease,
            me=me,
            boot_id=boot_id,
            live_writers=live_writers,
            claimant_runs=claimant_runs,
        )
        handovers, releasing = _intent(state, lease, success, reason, me)
        continued = False
    by_name = {spec.name: spec for spec in tokens}
    homes = tuple(
        _home_step(state, lease, releasing, token, by_name.get(token), continued)
        for token in lease.tokens
    )
    plan = ReleasePlan(lease.claimant, lease, releasing, handovers, homes, continued=continued)
    return project(state, plan, tokens, boot_id, parents)


def _intent(
    state: LedgerState, lease: Lease, success: bool, reason: str, me: ProcessRef
) -> tuple[tuple[Handover, ...], Lease | None]:
    """The hand-overs, and the lease as it turns releasing (or None: it ends at once).

    A shared lease that is not the last on a token sends that token nothing
    home.  A holder it stopped for such a token was stopped for the token, not
    for this claimant: its record moves to a shared lease that stays on it, and
    that one brings it back when the token's last user goes.  Never to a lease
    that is itself releasing (it may already have read its list of records), and
    never to the holder's own lease (a holder that came back and claimed by
    itself: its release must not start it again).  When every token stays in
    use and every record found an heir, there is nothing left to do: the lease
    ends at once, without ever being releasing.
    """
    others = [
        other
        for other in state.leases
        if other.claimant != lease.claimant
        and any(blocks_token(other, token) for token in lease.tokens)
    ]
    kept = lease.stopped
    handovers: list[Handover] = []
    heirs = sorted(
        (o for o in others if o.mode is Mode.SHARED and o.state is not LeaseState.RELEASING),
        key=lambda other: other.claimant,
    )
    if lease.mode is Mode.SHARED and heirs and lease.state is not LeaseState.RELEASING:
        held = {t for t in lease.tokens if any(blocks_token(o, t) for o in others)}
        kept = ()
        for record in lease.stopped:
            heir = None if record.restored else _shared_heir(record, lease, held, heirs)
            if heir is None:
                kept += (record,)
            else:
                handovers.append(Handover(record, heir))
        if held == set(lease.tokens) and all(record.restored for record in kept):
            return tuple(handovers), None
    steps = [
        (token, StepState.DONE if _not_due(lease, token, others) else StepState.PLANNED)
        for token in lease.tokens
    ]
    note = reason if reason else ("" if success else "failed")
    releasing = replace(
        lease,
        state=LeaseState.RELEASING,
        stopped=kept,
        switched=tuple(sorted(steps)),
        note=note or lease.note,
    ).owned_by(me)
    return tuple(handovers), releasing


def _shared_heir(
    record: StoppedHolder, lease: Lease, held: set[str], heirs: Sequence[Lease]
) -> Claimant | None:
    """The first shared lease, by name, that stays on a token the holder used.

    By name, not by ledger order: a lease moves to the end of the ledger each
    time it is written, and the plan should not depend on that.  A record from
    before tokens were recorded counts as using every token of the lease."""
    uses = set(record.tokens or lease.tokens) & held
    for heir in heirs:
        if heir.claimant != record.holder and uses & set(heir.tokens):
            return heir.claimant
    return None


def _not_due(lease: Lease, token: str, others: Sequence[Lease]) -> HomeWay | None:
    """Why this release need not send `token` home, or None when it must.

    Not when the acquire being rolled back never switched it (it is where it
    was: not ours to move), not when an earlier attempt of this release sent
    it home already, and not while another lease still holds it (a shared GPU
    stays home for its other users).  Holds, not names: a releasing lease that
    has let go of the token no longer counts, or a GPU could stay on vfio-pci
    with no lease at all (I2; the exhaustive test found it on a ledger the
    claim rules never write, where the check was `token in other.tokens`).
    """
    if lease.state is LeaseState.ACQUIRING and lease.switch_state(token) is None:
        return HomeWay.UNTOUCHED
    if lease.state is LeaseState.RELEASING and lease.switch_state(token) is StepState.DONE:
        return HomeWay.GONE_HOME
    if any(blocks_token(other, token) for other in others):
        return HomeWay.SHARED
    return None


def _home_step(
    state: LedgerState,
    before: Lease,
    releasing: Lease | None,
    token: str,
    spec: TokenSpec | None,
    continued: bool,
) -> HomeStep:
    """One token of the plan: how it goes home, or why it stays."""
    if releasing is None:
        return HomeStep(token, HomeWay.SHARED)  # the lease ends at once: all stay in use
    if releasing.switch_state(token) is StepState.PLANNED:
        return decide_home(state, token, spec)
    others = [o for o in state.leases if o.claimant != before.claimant]
    if continued:  # decided by the process that began the release; said as it stands
        holding = any(blocks_token(other, token) for other in others)
        return HomeStep(token, HomeWay.SHARED if holding else HomeWay.GONE_HOME)
    blocking = [o for o in others if any(blocks_token(o, t) for t in before.tokens)]
    return HomeStep(token, _not_due(before, token, blocking) or HomeWay.GONE_HOME)


def apply_intent(state: LedgerState, plan: ReleasePlan) -> LedgerState:
    """The ledger once the intent is written: the hand-overs, and the lease releasing
    (or gone)."""
    for handover in plan.handovers:
        heir = state.lease_of(handover.heir)
        if heir is not None:
            state = state.with_lease(heir.with_stopped(handover.record))
    if plan.lease is None:
        return state.without_lease(plan.claimant)
    return state.with_lease(plan.lease)


# -- 2. a token's way home ----------------------------------------------------------------


def decide_home(state: LedgerState, token: str, spec: TokenSpec | None) -> HomeStep:
    """How one token whose step is due goes home, its functions' drivers read now.

    Each function goes to its home driver (`planner.home_map`: as recorded at
    its first claim) when it is on vfio-pci or on another driver than its home
    one; a function already home stays.  A poisoned token is left where it is:
    nothing touches it until an operator has looked (`poison clear`); the lease
    lets go of it all the same, and I2 allows vfio-pci under a poison.  A token
    no longer configured cannot be switched (its functions are unknown): the
    lease stays for `restore` once it is configured again.
    """
    if spec is None:
        return HomeStep(token, HomeWay.UNKNOWN)
    if state.poison_of(token) is not None:
        return HomeStep(token, HomeWay.POISONED)
    home = home_map(state, spec)
    current = {function.address: function.driver for function in spec.functions}
    # An NVIDIA vGPU VF with a type is not home on nvidia: its way home clears the type.
    typed = {f.address for f in spec.functions if f.vgpu is not None and f.vgpu.current}
    switches = tuple(
        Switch(token, address, current.get(address), driver)
        for address, driver in home.items()
        # (A home of vfio-pci, `adopt --admin`'s, is where it stays.)
        if (current.get(address) == VFIO and driver != VFIO)
        or (driver and current.get(address) != driver)
        or address in typed
    )
    return HomeStep(token, HomeWay.SWITCH if switches else HomeWay.HOME, switches)


def apply_home(state: LedgerState, claimant: Claimant, token: str) -> LedgerState:
    """The token went home (or, poisoned, is let go of): its step is done."""
    lease = state.lease_of(claimant)
    if lease is None:
        return state
    return state.with_lease(lease.with_switch(token, StepState.DONE))


# -- 3. a stopped holder's way back -------------------------------------------------------


def decide_comeback(
    state: LedgerState, claimant: Claimant, attempted: Collection[Claimant]
) -> Comeback | None:
    """The next holder the lease of `claimant` brings back, newest stop first, and how;
    None when every record it holds has been dealt with (`attempted`) by this release.

    Decided under the lock, one holder at a time, on the ledger as it is then:

    - A logind session (`session:ID`, stopped for a screen) is never started again:
      a session cannot be resurrected, and what takes its place is the login
      screen of its display manager, which comes back by itself (ENDED: the record
      is marked restored, and the release says so).

    - An exclusive lease (another one, in any state: a releasing one too, since
      it brings back every record it holds before it ends) now holds one of the
      tokens the holder used: it stays stopped, and its record moves to that
      lease (HAND).  Started now, it would run beside a GPU on vfio-pci, and a
      preempted shared claimant's lease would come back beside an exclusive one
      (I1; issue 9's "claimant brought back beside a new exclusive lease").
    - A preempted shared claimant whose GPU this very lease still holds on
      vfio-pci (its way home failed) cannot have its lease back beside it: it
      stays stopped, the record with it, for `restore` (WAIT).
    - A display manager whose GPU this lease still holds (its way home failed, and
      it is still on vfio-pci) waits for it (WAIT): started without its card it
      would only fail.  The lease stays for `restore`, which sends the GPU home, or
      lets go of it poisoned (an operator's to look at), and then starts it, as
      any holder comes back beside a poisoned GPU; one that does not come up then
      ends on a text login (the host's start says so).
    - Another lease stopped it too (a ledger written before each holder was
      recorded once): that one brings it back (LEFT).
    - Otherwise it is started now (START): its record turns STARTING first,
      which keeps any new exclusive claim on its tokens waiting until it runs
      and, for a shared claimant, has its lease back (planner.decide_claim).
    """
    lease = state.lease_of(claimant)
    if lease is None:
        return None
    pending = [r for r in reversed(lease.unrestored()) if r.holder not in attempted]
    if not pending:
        return None
    record = pending[0]
    if record.holder.kind is HolderKind.SESSION:
        why = "a session cannot be resurrected; the display manager's login screen takes its place"
        return Comeback(claimant, record, ComebackWay.ENDED, why=why)
    heir = _exclusive_heir(state, claimant, record)
    if heir is not None:
        why = f"{heir} now holds {', '.join(_uses(record))} exclusively and brings it back"
        return Comeback(claimant, record, ComebackWay.HAND, heir, why)
    if record.shared_tokens and _still_holds(lease, record):
        why = f"{', '.join(record.shared_tokens)} is not home; `restore` brings it back"
        return Comeback(claimant, record, ComebackWay.WAIT, why=why)
    away = screen_not_home(state, lease, record)
    if away:
        why = (
            f"{', '.join(away)} is not home: {record.holder} would have no screen to draw on; "
            "`restore` starts it once it is"
        )
        return Comeback(claimant, record, ComebackWay.WAIT, why=why)
    also = sorted(
        other.claimant
        for other in state.leases
        if other.claimant != claimant and any(r.holder == record.holder for r in other.unrestored())
    )
    if also:
        return Comeback(claimant, record, ComebackWay.LEFT, also[0], f"{also[0]} stopped it too")
    starting = replace(record, state=StepState.STARTING)
    return Comeback(claimant, starting, ComebackWay.START)


def apply_comeback(state: LedgerState, comeback: Comeback) -> LedgerState:
    """What the decision writes: STARTING before a start; a hand-over moves the record
    (unless the heir already records the holder: one record each, I3)."""
    lease = state.lease_of(comeback.lease)
    if lease is None or comeback.way is ComebackWay.WAIT:
        return state
    record = comeback.record
    if comeback.way is ComebackWay.ENDED:
        return state.with_lease(lease.with_stopped(replace(record, restored=True)))
    if comeback.way is ComebackWay.START:
        return state.with_lease(lease.with_stopped(record))
    if comeback.way is ComebackWay.HAND and comeback.to is not None:
        heir = state.lease_of(comeback.to)
        if heir is not None and all(r.holder != record.holder for r in heir.unrestored()):
            state = state.with_lease(heir.with_stopped(replace(record, state=StepState.DONE)))
    return state.with_lease(lease.with_stopped(replace(record, restored=True)))


def apply_start_failed(state: LedgerState, comeback: Comeback) -> LedgerState:
    """A holder that would not start stays recorded (DONE: stopped), so the lease is
    kept and `restore` tries again."""
    lease = state.lease_of(comeback.lease)
    if lease is None:
        return state
    return state.with_lease(lease.with_stopped(replace(comeback.record, state=StepState.DONE)))


def screen_not_home(state: LedgerState, lease: Lease, record: StoppedHolder) -> tuple[str, ...]:
    """For a display manager's record: the tokens it drew on that `lease` still holds
    (on vfio-pci: their way home failed).  Empty for any other holder."""
    if record.holder.kind is not HolderKind.DISPLAY_MANAGER:
        return ()
    return tuple(token for token in _uses(record) or lease.tokens if blocks_token(lease, token))


def _uses(record: StoppedHolder) -> tuple[str, ...]:
    return record.tokens or record.shared_tokens


def _exclusive_heir(
    state: LedgerState, claimant: Claimant, record: StoppedHolder
) -> Claimant | None:
    """Another exclusive lease that holds one of the holder's tokens (the first by
    name; I1 allows one per token, a holder of two GPUs may meet two)."""
    heirs = sorted(
        other.claimant
        for other in state.leases
        if other.claimant not in (claimant, record.holder)
        and other.mode is Mode.EXCLUSIVE
        and any(blocks_token(other, token) for token in _uses(record))
    )
    return heirs[0] if heirs else None


def _still_holds(lease: Lease, record: StoppedHolder) -> bool:
    """Whether `lease`, exclusive, still holds one of the tokens `record` shared."""
    return lease.mode is Mode.EXCLUSIVE and any(
        blocks_token(lease, token) for token in record.shared_tokens
    )


# -- 4. after it came back: its shared lease ----------------------------------------------


def decide_return(
    state: LedgerState,
    claimant: Claimant,
    record: StoppedHolder,
    *,
    running: bool,
    home: Collection[str],
    parents: Mapping[str, str] | None = None,
) -> Return:
    """The shared lease a holder that came back gets again: on the tokens it shared
    that are home (`home`: every function off vfio-pci, read after its start).

    While its record was STARTING no exclusive claim could take those tokens,
    so the lease can be recreated without asking anyone again; but only where
    they are home.  One left on vfio-pci (poisoned on its way home) is shared by
    nobody: a lease there would say it is in use on its home driver, and
    clearing the poison would then leave a GPU on vfio-pci with no exclusive
    lease (I2; found by the long state machine).  Should a claim have got in
    all the same, the lease is not recreated beside it (`taken_meanwhile`, the
    last guard of I1).  A holder that does not run (a terminated process cannot
    be started again) gets none, and neither does one whose own hook claimed
    again while it started: that lease stands.  A token on a virtual function whose
    physical function's token (`parents`) another lease holds exclusively counts as
    taken too: a VF's lease is a use of its PF (core/vfs.py).
    """
    tokens = tuple(t for t in dict.fromkeys(record.shared_tokens) if running and t in home)
    taken = tuple(taken_meanwhile(state, claimant, record, tokens, parents or {}))
    if taken:
        return Return(record.holder, (), taken)
    if tokens and state.lease_of(record.holder) is not None:
        return Return(record.holder, (), own_lease=True)
    return Return(record.holder, tokens)


def taken_meanwhile(
    state: LedgerState,
    claimant: Claimant,
    record: StoppedHolder,
    tokens: tuple[str, ...],
    parents: Mapping[str, str] | None = None,
) -> list[str]:
    """Which of `tokens` another exclusive lease holds, itself or (for a token on a
    virtual function) through its physical function's token: the shared lease of
    the holder `claimant` brought back must not be recreated there (the last guard
    of I1; the planner's waiting for STARTING records is the first)."""
    parents = parents or {}
    return [
        token
        for token in dict.fromkeys(tokens)
        if any(
            other.mode is Mode.EXCLUSIVE
            and other.claimant not in (claimant, record.holder)
            and (
                blocks_token(other, token)
                or (token in parents and blocks_token(other, parents[token]))
            )
            for other in state.leases
        )
    ]


def home_now(spec: TokenSpec) -> bool:
    """Whether a token is home, as its functions read: every one off vfio-pci.  A token
    on a virtual function that does not exist now is not (there is nothing to use)."""
    return bool(spec.functions) and all(f.driver != VFIO for f in spec.functions)


def apply_return(
    state: LedgerState,
    comeback: Comeback,
    returned: Return,
    *,
    boot_id: str,
    created: str,
) -> LedgerState:
    """The holder is back: its record is restored, and its shared lease (if any) is
    written, active, of this boot."""
    lease = state.lease_of(comeback.lease)
    if lease is not None:
        state = state.with_lease(lease.with_stopped(replace(comeback.record, restored=True)))
    if not returned.tokens:
        return state
    return state.with_lease(
        Lease(
            claimant=returned.holder,
            mode=Mode.SHARED,
            tokens=returned.tokens,
            state=LeaseState.ACTIVE,
            transient=False,
            boot_id=boot_id,
            created=created,
        )
    )


# -- 5. the end ---------------------------------------------------------------------------


def decide_end(state: LedgerState, claimant: Claimant, attempted: Collection[Claimant]) -> End:
    """Whether the release is done once it has dealt with the records in `attempted`.

    Records handed to this lease meanwhile (an exclusive lease's comebacks
    hand it holders while it releases) are brought back too before it ends.
    It ends when every token is home and every holder back or handed on;
    otherwise it stays, with no writer, so that it is stranded and `restore`
    finishes it (a GPU that did not go home, a holder that did not start).
    """
    lease = state.lease_of(claimant)
    if lease is None:
        return End.GONE
    if any(record.holder not in attempted for record in lease.unrestored()):
        return End.MORE
    if not lease.unrestored() and all(step is StepState.DONE for _, step in lease.switched):
        return End.DONE
    return End.INCOMPLETE


def apply_end(state: LedgerState, claimant: Claimant, end: End) -> LedgerState:
    lease = state.lease_of(claimant)
    if lease is None or end is End.MORE:
        return state
    if end is End.DONE:
        return state.without_lease(claimant)
    return state.with_lease(lease.owned_by(None))


# -- the projection -----------------------------------------------------------------------


def project(
    state: LedgerState,
    plan: ReleasePlan,
    tokens: Sequence[TokenSpec],
    boot_id: str,
    parents: Mapping[str, str] | None = None,
) -> ReleasePlan:
    """The plan with the rest of the release run over the state its intent leads to:
    every due token home, every start a success, nothing else happening meanwhile."""
    state = apply_intent(state, plan)
    if plan.lease is None:
        return plan
    home = {spec.name for spec in tokens if home_now(spec)}
    for step in plan.homes:
        if step.due and step.way is not HomeWay.UNKNOWN:
            state = apply_home(state, plan.claimant, step.token)
            if step.way is not HomeWay.POISONED:
                home.add(step.token)
    comebacks: list[Comeback] = []
    returns: list[Return] = []
    attempted: set[Claimant] = set()
    while (comeback := decide_comeback(state, plan.claimant, attempted)) is not None:
        attempted.add(comeback.record.holder)
        comebacks.append(comeback)
        state = apply_comeback(state, comeback)
        if comeback.way is ComebackWay.START:
            returned = decide_return(
                state, plan.claimant, comeback.record, running=True, home=home, parents=parents
            )
            returns.append(returned)
            state = apply_return(state, comeback, returned, boot_id=boot_id, created="")
    end = decide_end(state, plan.claimant, attempted)
    return replace(plan, comebacks=tuple(comebacks), returns=tuple(returns), end=end)
