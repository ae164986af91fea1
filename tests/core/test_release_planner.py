"""The release's rules (core/release_planner.py) over every small ledger state.

As tests/core/test_planner.py does for claims: no I/O, every rule checked on
values.  The universe (`universe`) is every ledger of one or two leases, each
exclusive or shared, acquiring, active or releasing, on one GPU or two, with
each of its tokens' switch steps, and up to two stopped-holder records among
them (a plain holder, a preempted shared claimant, in each step state, restored
or not, with tokens or from an older ledger without), a GPU poisoned on
vfio-pci or not; the drivers and which holders run follow from the ledger, as
they would on a host.  Only states where I1-I3 hold are kept.  Each claimant
with a lease is released.

The oracle: I1-I3 (tests/invariants.py) after every step of the release the
plan leads to, carried out over a model of the host (`walk`: the intent, each
token's way home, each holder's way back and its shared lease, the end), with
no fault, with every switch failing and with every start failing; then each
rule's own property (`test_every_state_obeys_the_rules`), ordering and
determinism.  The refusals are exhaustive over their own inputs.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest
from invariants import HostFacts, violations

from charly_arbiter.core.host import PciFunction, TokenSpec
from charly_arbiter.core.model import (
    VFIO,
    Claimant,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    Poison,
    ProcessRef,
    StepState,
    StoppedHolder,
    blocks_token,
)
from charly_arbiter.core.release_planner import (
    Comeback,
    ComebackWay,
    End,
    HomeWay,
    ReleasePlan,
    Return,
    apply_comeback,
    apply_end,
    apply_home,
    apply_intent,
    apply_return,
    apply_start_failed,
    decide_comeback,
    decide_end,
    decide_release,
    decide_return,
    refuse_release,
)
from charly_arbiter.errors import ClaimantRunning, LeaseInProgress

GPU0, AUDIO0, GPU1 = "0000:0a:00.0", "0000:0a:00.1", "0000:0b:00.0"
TOKEN_FUNCTIONS = {"gpu0": (GPU0, AUDIO0), "gpu1": (GPU1,)}
HOME = {GPU0: "nvidia", AUDIO0: "snd_hda_intel", GPU1: "nvidia"}
TOKEN_SETS = (("gpu0",), ("gpu1",), ("gpu0", "gpu1"))

A = Claimant.parse("libvirt:a")  # claims either way
T = Claimant.parse("container:t")  # claims either way
S = Claimant.parse("container:s")  # shares, and is a holder of gpu0 (the model's SHARER)
H = Claimant.parse("systemd:h.service")  # a plain holder of gpu0
G = Claimant.parse("systemd:g.service")  # a plain holder of gpu1
# A screen released for a claim on gpu0 (`screen = "release"`): its display manager,
# started again once gpu0 is home, and a session, never started again (a session cannot
# be resurrected: it is not among the holders expected to run once it ended).
D = Claimant.parse("display-manager:d.service")
X = Claimant.parse("session:3")
HOLDERS = (H, G, S, D)  # they run unless the arbiter stopped them

BOOT = "boot"
ME = ProcessRef(1000, 1)  # the releasing process
HOOK = ProcessRef(500, 1)  # a hook that began a release and handed it on
DEAD = ProcessRef(7, 7)  # the writer of an in-progress lease, gone (a crash)

ACQUIRING, ACTIVE, RELEASING = LeaseState.ACQUIRING, LeaseState.ACTIVE, LeaseState.RELEASING
PLANNED, DONE, STARTING = StepState.PLANNED, StepState.DONE, StepState.STARTING
EXCLUSIVE, SHARED = Mode.EXCLUSIVE, Mode.SHARED


# -- the universe --------------------------------------------------------------------------


def lease(claimant: str, mode: Mode, tokens: tuple[str, ...], state: LeaseState, **kw) -> Lease:
    made = Lease(
        claimant=claimant,
        mode=mode,
        tokens=tokens,
        state=state,
        transient=False,
        boot_id=BOOT,
        created="2026-01-01T00:00:00+00:00",
        **kw,
    )
    return made if state is ACTIVE else made.owned_by(DEAD)


def shapes(claimant: Claimant, modes: tuple[Mode, ...]) -> list[Lease]:
    """Every lease `claimant` may hold, without records: each mode, token set, state,
    and switch step per token (an acquire that has not decided to switch a token, or
    has planned or done it; a release that has or has not sent it home)."""
    found = []
    for mode, tokens in itertools.product(modes, TOKEN_SETS):
        found.append(lease(claimant, mode, tokens, ACTIVE))
        for steps in itertools.product((None, PLANNED, DONE), repeat=len(tokens)):
            switched = tuple((t, s) for t, s in zip(tokens, steps, strict=True) if s is not None)
            found.append(lease(claimant, mode, tokens, ACQUIRING, switched=switched))
        for steps in itertools.product((PLANNED, DONE), repeat=len(tokens)):
            switched = tuple(zip(tokens, steps, strict=True))
            found.append(lease(claimant, mode, tokens, RELEASING, switched=switched))
    return found


def records(state: LeaseState) -> list[StoppedHolder]:
    """The stopped-holder records a lease in `state` may hold: a plain holder of gpu0
    or gpu1, a preempted shared claimant of gpu0, or one that held gpu0 and shared
    gpu1; planned (acquiring, or a rolled-back acquire), done, or starting (only a
    release starts); one restored; one from a ledger that did not record tokens."""
    steps = {ACQUIRING: (PLANNED, DONE), ACTIVE: (DONE,), RELEASING: (PLANNED, DONE, STARTING)}
    pool = [StoppedHolder(H, DONE, restored=True, tokens=("gpu0",)), StoppedHolder(H, DONE)]
    for step in steps[state]:
        pool += [
            StoppedHolder(H, step, tokens=("gpu0",)),
            StoppedHolder(G, step, tokens=("gpu1",)),
            StoppedHolder(S, step, ("gpu0",), tokens=("gpu0",)),
            StoppedHolder(S, step, ("gpu1",), tokens=("gpu0", "gpu1")),
            StoppedHolder(D, step, tokens=("gpu0",)),
            StoppedHolder(X, step, tokens=("gpu0",)),
        ]
    return pool


def on_vfio(state: LedgerState, token: str) -> bool:
    """Where an exclusive lease has put a token (the host as the ledger says)."""
    for item in state.leases:
        if item.mode is not EXCLUSIVE or token not in item.tokens:
            continue
        step = item.switch_state(token)
        if (
            item.state is ACTIVE
            or (item.state is ACQUIRING and step is DONE)
            or (item.state is RELEASING and step is PLANNED)
        ):
            return True
    return False


@dataclass(frozen=True)
class Case:
    """A ledger and the host that goes with it."""

    state: LedgerState
    vfio: frozenset[str]  # tokens whose functions are on vfio-pci
    running: frozenset[Claimant]

    def tokens(self) -> list[TokenSpec]:
        return [spec(name, name in self.vfio) for name in TOKEN_FUNCTIONS]

    def facts(self) -> HostFacts:
        return facts(self.vfio, self.running)


def spec(name: str, vfio: bool) -> TokenSpec:
    addresses = TOKEN_FUNCTIONS[name]
    functions = tuple(
        PciFunction(
            a,
            "10de",
            "0000",
            "030000" if a != AUDIO0 else "040300",
            VFIO if vfio else HOME[a],
            name,
        )
        for a in addresses
    )
    return TokenSpec(name, addresses[0], functions)


@functools.cache
def facts(vfio: frozenset[str], running: frozenset[Claimant]) -> HostFacts:
    drivers = {
        a: (VFIO if t in vfio else HOME[a]) for t, addrs in TOKEN_FUNCTIONS.items() for a in addrs
    }
    return HostFacts(
        drivers, TOKEN_FUNCTIONS, {h: h in running for h in HOLDERS}, frozenset(HOLDERS)
    )


def running_holders(state: LedgerState) -> frozenset[Claimant]:
    """A holder runs unless a lease stopped it (a planned stop has not happened yet);
    a shared claimant with a lease of its own runs (it came back by itself)."""
    stopped = {
        r.holder for item in state.leases for r in item.unrestored() if r.state is not PLANNED
    }
    return frozenset(h for h in HOLDERS if h not in stopped or state.lease_of(h) is not None)


def sane(state: LedgerState) -> bool:
    """What no release or claim writes: a lease recording its own claimant, one holder
    recorded twice in one lease."""
    for item in state.leases:
        holders = [r.holder for r in item.stopped]
        if item.claimant in holders or len(holders) != len(set(holders)):
            return False
    return True


def universe(poisoned_pairs: bool = True) -> Iterator[Case]:
    """Every state of one or two leases with up to one record, and of one lease with
    two; each with its host, and with each GPU that matters poisoned on vfio-pci
    (for two leases only with `poisoned_pairs`: the quick run leaves them out).

    libvirt:a and container:t are the same kind of claimant: a pair of their leases
    is enumerated one way round, and only libvirt:a's holds a record (the other
    way round is the same state, renamed)."""
    homes = LedgerState()
    for name, addresses in TOKEN_FUNCTIONS.items():
        homes = homes.with_home(name, {a: HOME[a] for a in addresses})
    a_shapes = shapes(A, (EXCLUSIVE, SHARED))
    t_shapes = shapes(T, (EXCLUSIVE, SHARED))
    s_shapes = shapes(S, (SHARED,))
    groups: list[tuple[tuple[Lease, bool], ...]] = [((x, True),) for x in a_shapes + s_shapes]
    groups += [((x, True), (y, False)) for x in a_shapes for y in t_shapes]
    groups += [((x, True), (y, True)) for x in a_shapes for y in s_shapes]
    for group in groups:
        for index, (item, may_record) in enumerate(group):
            for record in [None, *records(item.state)] if may_record else [None]:
                if record is None and index > 0:
                    continue  # the state with no record is enumerated once
                leases = tuple(
                    replace(other, stopped=(record,)) if at == index and record else other
                    for at, (other, _) in enumerate(group)
                )
                poison = poisoned_pairs or len(leases) == 1
                yield from _with_hosts(replace(homes, leases=leases), poison)
    # Two records in one lease, beside no other lease: which comes back first, and
    # how one's way back meets the other's (a restored record or one from an old
    # ledger adds nothing here that one record alone does not show).
    for item in a_shapes + s_shapes:
        pool = [r for r in records(item.state) if r.tokens and not r.restored]
        for first, second in itertools.permutations(pool, 2):
            yield from _with_hosts(replace(homes, leases=(replace(item, stopped=(first, second)),)))


def _with_hosts(state: LedgerState, poison: bool = True) -> Iterator[Case]:
    if not sane(state):
        return
    vfio = frozenset(t for t in TOKEN_FUNCTIONS if on_vfio(state, t))
    running = running_holders(state)
    variants = [(state, vfio)]
    shared = {t for item in state.leases for r in item.stopped for t in r.shared_tokens}
    for token in sorted(vfio | shared) if poison else ():
        # A switch that failed or hung: the GPU left on vfio-pci, poisoned (where it
        # matters: a GPU an exclusive lease holds, or one a stopped claimant shared).
        poisoned = state.with_poison(token, Poison("unbind hung", "2026-01-01T00:00:00+00:00"))
        variants.append((poisoned, vfio | {token}))
    for ledger, on in variants:
        case = Case(ledger, on, running)
        if not violations(ledger, case.facts()):
            yield case


# -- carrying a plan out over a model of the host ------------------------------------------


@dataclass
class Walk:
    """What one release did, step by step, over the model host."""

    plan: ReleasePlan
    states: list[tuple[str, LedgerState, frozenset[str], frozenset[Claimant]]] = field(
        default_factory=list
    )
    comebacks: list[tuple[LedgerState, Comeback]] = field(default_factory=list)
    returns: list[tuple[LedgerState, Comeback, Return, frozenset[str]]] = field(
        default_factory=list
    )
    end: End = End.GONE

    @property
    def final(self) -> LedgerState:
        return self.states[-1][1]


def walk(
    case: Case, plan: ReleasePlan, *, bad_switch: bool = False, bad_start: bool = False
) -> Walk:
    """The release as core/releasing.py carries it out, over a host that is a few
    sets: `bad_switch`, every switch fails (the GPU stays on vfio-pci, poisoned);
    `bad_start`, no holder starts."""
    claimant = plan.claimant
    vfio, running = set(case.vfio), set(case.running)
    done = Walk(plan)

    def note(label: str, state: LedgerState) -> LedgerState:
        done.states.append((label, state, frozenset(vfio), frozenset(running)))
        return state

    state = note("intent", apply_intent(case.state, plan))
    if plan.lease is None:
        return done
    for step in plan.homes:
        if not step.due or step.way is HomeWay.UNKNOWN:
            continue
        if step.way is HomeWay.SWITCH:
            if bad_switch:
                poison = Poison("switch failed", "2026-01-01T00:00:00+00:00")
                state = note(f"{step.token} failed", state.with_poison(step.token, poison))
                continue
            vfio.discard(step.token)
        state = note(f"{step.token} home", apply_home(state, claimant, step.token))
    attempted: set[Claimant] = set()
    while True:
        while (comeback := decide_comeback(state, claimant, attempted)) is not None:
            holder = comeback.record.holder
            attempted.add(holder)
            done.comebacks.append((state, comeback))
            state = note(f"{holder} {comeback.way}", apply_comeback(state, comeback))
            if comeback.way is not ComebackWay.START:
                continue
            if bad_start:
                state = note(f"{holder} failed", apply_start_failed(state, comeback))
                continue
            running.add(holder)
            home = frozenset(t for t in TOKEN_FUNCTIONS if t not in vfio)
            returned = decide_return(state, claimant, comeback.record, running=True, home=home)
            done.returns.append((state, comeback, returned, home))
            state = apply_return(state, comeback, returned, boot_id=BOOT, created="now")
            state = note(f"{holder} back", state)
        done.end = decide_end(state, claimant, attempted)
        state = note(f"end {done.end}", apply_end(state, claimant, done.end))
        if done.end is not End.MORE:
            return done


def assert_safe(case: Case, done: Walk, where: str) -> None:
    for label, state, vfio, running in done.states:
        problems = violations(state, facts(vfio, running))
        assert not problems, f"{where}, after {label}: {problems}\n{case.state}"


# -- the rules, checked on every state -------------------------------------------------------


def others(state: LedgerState, claimant: Claimant) -> list[Lease]:
    return [item for item in state.leases if item.claimant != claimant]


def uses(record: StoppedHolder) -> set[str]:
    return set(record.tokens or record.shared_tokens)


def check_release(case: Case, claimant: Claimant, takeover: ProcessRef | None) -> int:
    """Every rule of one release, from `case`; returns how many walks it checked."""
    state = case.state
    before = state.lease_of(claimant)
    assert before is not None
    if takeover is not None:
        state = state.with_lease(before.owned_by(takeover))
        case = replace(case, state=state)
        before = state.lease_of(claimant)
        assert before is not None
    where = f"release {claimant}{' (taken over)' if takeover else ''} from {case}"
    plan = decide_release(state, claimant, case.tokens(), me=ME, boot_id=BOOT, takeover=takeover)
    assert plan is not None, where
    check_intent(state, before, plan, takeover, where)
    check_homes(case, before, plan, where)
    done = walk(case, plan)
    assert_safe(case, done, where)
    check_comebacks(plan, done, where)
    check_returns(done, where)
    # The plan's projection is what the release does while nothing else happens.
    projected = (plan.comebacks, plan.returns, plan.end)
    walked = (
        tuple(comeback for _, comeback in done.comebacks),
        tuple(returned for _, _, returned, _ in done.returns),
        done.end if plan.lease is not None else End.DONE,
    )
    assert walked == projected, where
    # Nothing else happening, every release ends: the lease goes, every token it
    # sent home is home.
    assert done.final.lease_of(claimant) is None, (where, done.final)
    assert not any(c.way is ComebackWay.WAIT for _, c in done.comebacks), where
    walks = 1
    faults = []
    if any(step.way is HomeWay.SWITCH for step in plan.homes):
        faults.append({"bad_switch": True})
    if any(c.way is ComebackWay.START for c in plan.comebacks):
        faults.append({"bad_start": True})
    for fault in faults:
        failed = walk(case, plan, **fault)
        assert_safe(case, failed, f"{where}, {fault}")
        check_comebacks(plan, failed, f"{where}, {fault}")
        # What could not be done is left for `restore`: the lease stays, with no
        # writer, so that it is stranded ...
        assert failed.end is End.INCOMPLETE, (where, fault)
        kept = failed.final.lease_of(claimant)
        assert kept is not None and kept.owner is None, (where, fault)
        # ... and `restore`, the fault mended, finishes it.
        _, last, vfio, running = failed.states[-1]
        after = Case(last, vfio, running)
        again = decide_release(last, claimant, after.tokens(), me=ME, boot_id=BOOT)
        assert again is not None
        redone = walk(after, again)
        assert_safe(after, redone, f"{where}, {fault}, then restore")
        assert redone.final.lease_of(claimant) is None, (where, fault, redone.final)
        walks += 2
    return walks


def check_intent(
    state: LedgerState, before: Lease, plan: ReleasePlan, takeover: ProcessRef | None, where: str
) -> None:
    if takeover is not None and before.state is RELEASING:
        # A release its hook began is continued as it stands, by this process.
        assert plan.continued and plan.handovers == (), where
        assert plan.lease == before.owned_by(ME), where
        return
    assert not plan.continued, where
    rest = others(state, claimant := before.claimant)
    blocking = [o for o in rest if any(blocks_token(o, t) for t in before.tokens)]
    held = {t for t in before.tokens if any(blocks_token(o, t) for o in blocking)}
    heirs = [o for o in blocking if o.mode is SHARED and o.state is not RELEASING]
    hands = before.mode is SHARED and before.state is not RELEASING and bool(heirs)

    def eligible(record: StoppedHolder, heir: Lease) -> bool:
        # A shared lease that stays on a GPU the holder used, never its own lease.
        wanted = set(record.tokens or before.tokens) & held
        return heir.claimant != record.holder and bool(wanted & set(heir.tokens))

    handed = {h.record.holder: h for h in plan.handovers}
    for handover in plan.handovers:
        assert hands and not handover.record.restored, where
        assert handover.record in before.stopped, where
        heir = state.lease_of(handover.heir)
        assert heir is not None and heir in heirs and eligible(handover.record, heir), where
        # The first eligible heir by name: the ledger's order decides nothing.
        first = min(o.claimant for o in heirs if eligible(handover.record, o))
        assert handover.heir == first, where
    for record in before.stopped:
        if record.holder not in handed and hands and not record.restored:
            assert not any(eligible(record, heir) for heir in heirs), (where, record)
    kept = tuple(r for r in before.stopped if r.holder not in handed)
    ends_at_once = hands and held == set(before.tokens) and all(r.restored for r in kept)
    if ends_at_once:
        assert plan.lease is None, where
        return
    assert plan.lease is not None, where
    assert plan.lease.state is RELEASING and plan.lease.owner == ME, where
    assert (plan.lease.claimant, plan.lease.mode, plan.lease.tokens) == (
        claimant,
        before.mode,
        before.tokens,
    ), where
    assert plan.lease.stopped == kept, where
    for token in before.tokens:
        untouched = before.state is ACQUIRING and before.switch_state(token) is None
        gone = before.state is RELEASING and before.switch_state(token) is DONE
        still_used = any(blocks_token(o, token) for o in rest)
        due = not (untouched or gone or still_used)
        assert plan.lease.switch_state(token) is (PLANNED if due else DONE), (where, token)


def check_homes(case: Case, before: Lease, plan: ReleasePlan, where: str) -> None:
    assert [step.token for step in plan.homes] == list(before.tokens), where
    for step in plan.homes:
        planned = plan.lease is not None and plan.lease.switch_state(step.token) is PLANNED
        assert step.due is planned, (where, step)
        poisoned = case.state.poison_of(step.token) is not None
        if step.way is HomeWay.SWITCH:
            # Every function off its home driver goes home, and nothing else moves.
            assert not poisoned, where
            addresses = TOKEN_FUNCTIONS[step.token]
            assert step.targets == {a: HOME[a] for a in addresses if step.token in case.vfio}
            assert step.targets and all(s.from_driver == VFIO for s in step.switches), where
            # Never a GPU another lease still holds.
            assert not any(blocks_token(o, step.token) for o in others(case.state, plan.claimant))
        elif step.way is HomeWay.HOME:
            assert not poisoned and step.token not in case.vfio, (where, step)
        elif step.way is HomeWay.POISONED:
            assert poisoned, (where, step)


def check_comebacks(plan: ReleasePlan, done: Walk, where: str) -> None:
    if plan.lease is None:
        assert done.comebacks == [], where
        return
    # Newest stop first, each holder once, every record the lease kept.
    order = [r.holder for r in reversed(plan.lease.unrestored())]
    assert [c.record.holder for _, c in done.comebacks] == order, where
    for state, comeback in done.comebacks:
        lease = state.lease_of(plan.claimant)
        assert lease is not None
        record = comeback.record
        exclusive = sorted(
            o.claimant
            for o in others(state, plan.claimant)
            if o.claimant != record.holder
            and o.mode is EXCLUSIVE
            and any(blocks_token(o, t) for t in uses(record))
        )
        waits = lease.mode is EXCLUSIVE and any(
            blocks_token(lease, t) for t in record.shared_tokens
        )
        also = [
            o.claimant
            for o in others(state, plan.claimant)
            if any(r.holder == record.holder for r in o.unrestored())
        ]
        away = record.holder == D and any(blocks_token(lease, t) for t in uses(record))
        if record.holder == X:
            # A session is never started again, whoever holds its GPU now.
            assert comeback.way is ComebackWay.ENDED, where
        elif exclusive:
            # Never started beside an exclusive lease on its GPU: handed to it.
            assert comeback.way is ComebackWay.HAND and comeback.to == exclusive[0], where
        elif waits:
            # A shared claimant waits while its GPU is still on vfio-pci here.
            assert comeback.way is ComebackWay.WAIT, where
        elif away:
            # A display manager waits for its GPU: without it, it would only fail.
            assert comeback.way is ComebackWay.WAIT, where
        elif also:
            assert comeback.way is ComebackWay.LEFT and comeback.to in also, where
        else:
            assert comeback.way is ComebackWay.START, where
            assert record.state is STARTING, where


def check_returns(done: Walk, where: str) -> None:
    for state, comeback, returned, home in done.returns:
        record = comeback.record
        assert returned.holder == record.holder, where
        free = [
            t
            for t in record.shared_tokens
            if t in home
            and not any(
                o.mode is EXCLUSIVE and o.claimant != record.holder and blocks_token(o, t)
                for o in others(state, comeback.lease)
            )
        ]
        wanted = [t for t in record.shared_tokens if t in home]
        if free != wanted:
            assert returned.tokens == () and returned.taken, where
        elif wanted and state.lease_of(record.holder) is not None:
            # Its own hook claimed again while it started: that lease stands.
            assert returned.tokens == () and returned.own_lease, where
        else:
            # Back on every GPU it shared that is home: never on one left on vfio-pci.
            assert returned.tokens == tuple(wanted), (where, returned, home)


FAMILIES = {
    "one lease": lambda case: (
        len(case.state.leases) == 1 and sum(len(x.stopped) for x in case.state.leases) < 2
    ),
    "a and t": lambda case: {x.claimant for x in case.state.leases} == {A, T},
    "a and s": lambda case: {x.claimant for x in case.state.leases} == {A, S},
    "two records": lambda case: sum(len(x.stopped) for x in case.state.leases) == 2,
}


@functools.cache
def cases(poisoned_pairs: bool) -> tuple[Case, ...]:
    return tuple(universe(poisoned_pairs))


def release_every_claimant(family: str, poisoned_pairs: bool) -> None:
    """Every claimant's release, as decided and, for a releasing lease alone in the
    ledger, as taken over from its hook.  Beside a lease that holds a record, a
    lease without records is not released again: its release cannot meet the
    record, and the same state without it releases it."""
    started = time.monotonic()
    states = releases = walks = 0
    for case in cases(poisoned_pairs):
        if not FAMILIES[family](case):
            continue
        states += 1
        leases = case.state.leases
        recording = [item for item in leases if item.stopped]
        for item in recording if len(leases) == 2 and recording else leases:
            alone = len(leases) == 1 and item.state is RELEASING
            for takeover in (None, HOOK) if alone else (None,):
                walks += check_release(case, item.claimant, takeover)
                releases += 1
    print(
        f"\n{family}: {states} states, {releases} releases, {walks} walks "
        f"in {time.monotonic() - started:.1f} s"
    )
    assert states > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_state_obeys_the_rules(family):
    """Exhaustive over the universe, two leases without a poisoned GPU."""
    release_every_claimant(family, poisoned_pairs=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["a and t", "a and s"])
def test_every_state_obeys_the_rules_with_poisoned_pairs(family):
    """The same over two leases with each GPU that matters poisoned on vfio-pci."""
    release_every_claimant(family, poisoned_pairs=True)


# -- the rules the universe cannot reach --------------------------------------------------


WRITERS = {"none": None, "me": ME, "the hook": HOOK, "alive": ProcessRef(900, 9), "dead": DEAD}


@pytest.mark.parametrize("lease_state", list(LeaseState))
@pytest.mark.parametrize("boot", ["this", "earlier"])
@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("takeover", [None, HOOK])
def test_every_refusal(lease_state, boot, writer, runs, takeover):
    """Exhaustive over what a refusal depends on: the lease's state, boot and writer,
    whether its claimant runs, and whether the release is taken over from a hook."""
    item = replace(
        lease(A, EXCLUSIVE, ("gpu0",), lease_state),
        boot_id=BOOT if boot == "this" else "old",
    ).owned_by(WRITERS[writer])
    state = LedgerState(leases=(item,))
    alive = {ME, HOOK, ProcessRef(900, 9)}
    decide = lambda: decide_release(  # noqa: E731
        state,
        A,
        [spec("gpu0", True)],
        me=ME,
        boot_id=BOOT,
        live_writers=alive,
        claimant_runs=runs,
        takeover=takeover,
    )
    continued = takeover is not None and lease_state is RELEASING and writer == "the hook"
    this_boot = boot == "this"
    if runs and lease_state is ACTIVE and this_boot and not continued:
        # Its GPU would go home under it.
        with pytest.raises(ClaimantRunning, match="libvirt:a still runs"):
            decide()
    elif (
        lease_state is not ACTIVE
        and writer in ("the hook", "alive")
        and this_boot
        and not continued
    ):
        # Another live process carries it out (a reused pid is not alive: `live_writers`).
        with pytest.raises(LeaseInProgress, match=f"by process {WRITERS[writer].pid}"):
            decide()
    else:
        plan = decide()
        assert plan is not None and plan.continued is continued
        assert plan.lease is not None and plan.lease.owner == ME
    # The same refusal, on its own.
    try:
        decide()
    except (ClaimantRunning, LeaseInProgress) as refused:
        if not continued:
            with pytest.raises(type(refused)):
                refuse_release(item, me=ME, boot_id=BOOT, live_writers=alive, claimant_runs=runs)


def test_no_lease_is_no_plan():
    assert decide_release(LedgerState(), A, [], me=ME, boot_id=BOOT) is None


def shared_with(record: StoppedHolder, *names: str) -> LedgerState:
    """A shared lease of libvirt:a on gpu0 that stopped `record`, beside shared leases
    of `names` on gpu0 (possible heirs)."""
    state = LedgerState(leases=(replace(lease(A, SHARED, ("gpu0",), ACTIVE), stopped=(record,)),))
    for name in names:
        state = state.with_lease(lease(name, SHARED, ("gpu0",), ACTIVE))
    return state


def test_an_heir_is_chosen_by_name_not_by_ledger_order():
    """Three leases, every order of them in the ledger: the same plan (a lease moves to
    the end of the ledger each time it is written; the plan must not follow that)."""
    record = StoppedHolder(H, DONE, tokens=("gpu0",))
    state = shared_with(record, "container:u", "container:t")
    plans = {
        decide_release(replace(state, leases=order), A, [spec("gpu0", False)], me=ME, boot_id=BOOT)
        for order in itertools.permutations(state.leases)
    }
    assert len(plans) == 1
    (plan,) = plans
    assert plan is not None and [(h.record.holder, h.heir) for h in plan.handovers] == [
        (H, "container:t")
    ]
    assert plan.lease is None  # every token stays in use: the lease ends at once


def test_never_to_the_holders_own_lease_even_when_it_comes_first():
    """container:s came back by itself and shares gpu0 again: the record of it goes to
    container:t, never to its own lease (whose release would then start it again)."""
    record = StoppedHolder(S, DONE, ("gpu0",), tokens=("gpu0",))
    plan = decide_release(
        shared_with(record, S, "container:t"), A, [spec("gpu0", False)], me=ME, boot_id=BOOT
    )
    assert plan is not None and [h.heir for h in plan.handovers] == ["container:t"]
    alone = decide_release(shared_with(record, S), A, [spec("gpu0", False)], me=ME, boot_id=BOOT)
    assert alone is not None and alone.handovers == ()
    assert alone.lease is not None and alone.lease.stopped == (record,)
    # It runs already: its lease stays as it is, and no second one is written.
    assert [c.way for c in alone.comebacks] == [ComebackWay.START]
    assert alone.returns == (Return(S, (), own_lease=True),)


def test_two_exclusive_heirs_the_first_by_name():
    """A holder of both GPUs, stopped by a shared lease, finds gpu0 and gpu1 each held
    exclusively by another VM when it would come back: it goes to the first by name,
    whatever the ledger's order."""
    record = StoppedHolder(H, DONE, tokens=("gpu0", "gpu1"))
    releasing = replace(
        lease(A, SHARED, ("gpu0", "gpu1"), RELEASING, switched=(("gpu0", DONE), ("gpu1", DONE))),
        stopped=(record,),
    )
    b = lease("libvirt:b", EXCLUSIVE, ("gpu1",), ACTIVE)
    c = lease("libvirt:c", EXCLUSIVE, ("gpu0",), ACTIVE)
    for order in itertools.permutations((releasing, b, c)):
        comeback = decide_comeback(LedgerState(leases=order), A, ())
        assert comeback is not None and comeback.way is ComebackWay.HAND
        assert comeback.to == "libvirt:b"


def test_the_last_guard_no_shared_lease_back_beside_an_exclusive_one():
    """A claim got in while container:s was being started (the planner's wait for a
    STARTING record is the first guard; this is the last): no lease back on gpu0."""
    record = StoppedHolder(S, STARTING, ("gpu0",), tokens=("gpu0",))
    releasing = replace(
        lease(A, EXCLUSIVE, ("gpu0",), RELEASING, switched=(("gpu0", DONE),)), stopped=(record,)
    )
    meanwhile = lease("libvirt:b", EXCLUSIVE, ("gpu0",), ACQUIRING, switched=(("gpu0", PLANNED),))
    state = LedgerState(leases=(releasing, meanwhile))
    returned = decide_return(state, A, record, running=True, home={"gpu0"})
    assert returned == Return(S, (), taken=("gpu0",))
    # Without the claim, it gets its lease back.
    alone = LedgerState(leases=(releasing,))
    assert decide_return(alone, A, record, running=True, home={"gpu0"}).tokens == ("gpu0",)
    # Not running (a terminated process), or its GPU not home: none.
    assert decide_return(alone, A, record, running=False, home={"gpu0"}).tokens == ()
    assert decide_return(alone, A, record, running=True, home=set()).tokens == ()


def test_records_handed_to_a_lease_while_it_releases_are_brought_back_too():
    """libvirt:a releases; meanwhile another release hands it systemd:g (a hand-over to
    the exclusive lease that holds gpu1): a's release brings g back as well before
    it ends."""
    first = StoppedHolder(H, DONE, tokens=("gpu0",))
    item = replace(
        lease(A, EXCLUSIVE, ("gpu0", "gpu1"), RELEASING, switched=(("gpu0", DONE), ("gpu1", DONE))),
        stopped=(first,),
    )
    state = LedgerState(leases=(item,))
    comeback = decide_comeback(state, A, ())
    assert comeback is not None and comeback.way is ComebackWay.START
    state = apply_comeback(state, comeback)
    state = apply_return(state, comeback, Return(H, ()), boot_id=BOOT, created="now")
    handed = StoppedHolder(G, DONE, tokens=("gpu1",))
    current = state.lease_of(A)
    assert current is not None
    state = state.with_lease(current.with_stopped(handed))
    assert decide_end(state, A, {H}) is End.MORE
    later = decide_comeback(state, A, {H})
    assert later is not None and later.record.holder == G and later.way is ComebackWay.START


def test_a_holder_handed_back_to_a_lease_that_restored_it_comes_back_as_the_newest():
    """A releasing lease brought H back, and another release hands H to it again
    (stopped again meanwhile) while it still has G to bring back: H is now the
    newest record, so it comes back first, as if recorded last (not in the place
    of its old, restored record)."""
    g = StoppedHolder(G, DONE, tokens=("gpu1",))
    h = StoppedHolder(H, DONE, tokens=("gpu0",))
    item = replace(
        lease(A, EXCLUSIVE, ("gpu0", "gpu1"), RELEASING, switched=(("gpu0", DONE), ("gpu1", DONE))),
        stopped=(replace(h, restored=True), g),
    )
    again = item.with_stopped(h)
    assert [r.holder for r in again.stopped] == [G, H]
    comeback = decide_comeback(LedgerState(leases=(again,)), A, ())
    assert comeback is not None and comeback.record.holder == H
    # A record it still holds changes in its place.
    assert [r.holder for r in again.with_stopped(replace(g, restored=True)).stopped] == [G, H]


def test_a_holder_two_leases_recorded_is_left_to_the_other():
    """A ledger that records one holder in two leases (I3 broken, as an older version
    could leave it): the release leaves the holder to the other lease instead of
    starting it, and I3 holds again after."""
    record = StoppedHolder(H, DONE, tokens=("gpu0",))
    mine = replace(lease(A, SHARED, ("gpu1",), ACTIVE), stopped=(record,))
    theirs = replace(lease(T, SHARED, ("gpu0",), ACTIVE), stopped=(record,))
    state = LedgerState(leases=(mine, theirs))
    case = Case(state, frozenset(), frozenset({G, S, D}))
    assert violations(state, case.facts())  # I3: two records
    plan = decide_release(state, A, case.tokens(), me=ME, boot_id=BOOT)
    assert plan is not None
    assert [(c.record.holder, c.way, c.to) for c in plan.comebacks] == [(H, ComebackWay.LEFT, T)]
    done = walk(case, plan)
    assert not violations(done.final, facts(frozenset(), frozenset({G, S, D})))


def test_a_gpu_no_longer_configured_keeps_the_lease_for_restore():
    """gpu1 was removed from arbiter.toml while libvirt:a held it: it cannot be switched
    (its functions are unknown), so the lease stays, and says so."""
    item = lease(A, EXCLUSIVE, ("gpu0", "gpu1"), ACTIVE)
    plan = decide_release(LedgerState(leases=(item,)), A, [spec("gpu0", True)], me=ME, boot_id=BOOT)
    assert plan is not None
    assert [(s.token, s.way) for s in plan.homes] == [
        ("gpu0", HomeWay.SWITCH),
        ("gpu1", HomeWay.UNKNOWN),
    ]
    assert plan.end is End.INCOMPLETE


# -- the executor carries the plan out as planned ------------------------------------------

# The universe's holders as the default simulated host names them.
ON_SIM = {
    H: "systemd:ollama.service",
    G: "systemd:display-manager.service",
    S: "container:llm",
    D: "display-manager:gdm.service",
    X: "session:3",
}


def on_sim(state: LedgerState, boot_id: str, writer: ProcessRef) -> LedgerState:
    """The state with the simulated host's holder names, its boot, and a dead writer."""

    def name(ref: Claimant) -> str:
        return ON_SIM.get(ref, ref)

    leases = tuple(
        replace(
            item,
            claimant=name(item.claimant),
            boot_id=boot_id,
            stopped=tuple(replace(r, holder=name(r.holder)) for r in item.stopped),
        ).owned_by(writer if item.owner is not None else None)
        for item in state.leases
    )
    return replace(state, leases=leases)


def samples() -> list[tuple[Case, Claimant]]:
    """A few states of every kind: for each family, the way the first holder comes
    back and whether a GPU switches, the first two states of the universe."""
    picked: dict[tuple[str, object, bool], list[tuple[Case, Claimant]]] = {}
    for case in cases(False):
        family = next(name for name, belongs in FAMILIES.items() if belongs(case))
        item = next((x for x in case.state.leases if x.stopped), case.state.leases[0])
        plan = decide_release(case.state, item.claimant, case.tokens(), me=ME, boot_id=BOOT)
        assert plan is not None
        first = plan.comebacks[0].way if plan.comebacks else None
        switches = any(step.way is HomeWay.SWITCH for step in plan.homes)
        kind = picked.setdefault((family, first, switches), [])
        if len(kind) < 2:
            kind.append((case, item.claimant))
    return [sample for kind in picked.values() for sample in kind]


def test_the_release_does_what_its_plan_says(make_sim, dead_pid):
    """The real Releaser on the simulated host, from a sample of the universe's states:
    the plan `plan --release` shows (decided over the host as it is) is the one the
    pure test decides, and the release then starts the holders in its order and
    leaves the ledger, the drivers and the holders as the plan's walk does."""
    from coretools import bind_by_hand

    chosen = samples()
    assert len(chosen) >= 30
    for index, (case, claimant) in enumerate(chosen):
        sim = make_sim(name=f"sample{index}")
        arbiter = sim.arbiter()
        host = arbiter.host
        writer = ProcessRef(dead_pid, 0)
        with arbiter.ledger.transaction() as txn:
            txn.state = on_sim(case.state, host.boot_id(), writer)
        bind_by_hand(sim.sim_dir, {a: VFIO for t in case.vfio for a in TOKEN_FUNCTIONS[t]})
        for ref in (*HOLDERS, A, T):
            host.set_running(ON_SIM.get(ref, ref), ref in case.running)
        where = f"sample {index}: release {claimant} from {case}"
        name = ON_SIM.get(claimant, claimant)

        planned = arbiter.plan_release(name, force=True)
        pure = decide_release(case.state, claimant, case.tokens(), me=ME, boot_id=BOOT)
        assert planned is not None and pure is not None, where
        assert [(ON_SIM.get(c.record.holder, c.record.holder), c.way) for c in pure.comebacks] == [
            (c.record.holder, c.way) for c in planned.comebacks
        ], where
        assert [(s.token, s.way, s.switches) for s in pure.homes] == [
            (s.token, s.way, s.switches) for s in planned.homes
        ], where

        logged = len(host.snapshot()["log"])
        arbiter.release_claimant(name, force=True)
        log = host.snapshot()["log"][logged:]
        started = [
            ON_SIM[c.record.holder]
            for c in pure.comebacks
            if c.way is ComebackWay.START and c.record.holder not in case.running
        ]
        assert [line for line in log if line.startswith("start ")] == [
            f"start {ref}" for ref in started
        ], (where, log)
        done = walk(case, pure)
        _, final, vfio, running = done.states[-1]
        leases = {(x.claimant, x.mode, x.tokens, x.state) for x in arbiter.ledger.read().leases}
        assert leases == {
            (ON_SIM.get(x.claimant, x.claimant), x.mode, x.tokens, x.state) for x in final.leases
        }, where
        drivers = host.snapshot()["drivers"]
        assert {t for t, addrs in TOKEN_FUNCTIONS.items() if drivers[addrs[0]] == VFIO} == vfio
        for ref in HOLDERS:
            assert host.is_running(ON_SIM[ref]) is (ref in running), (where, ref)


# -- SR-IOV: a VF's lease is a use of its PF (core/vfs.py) -------------------------------

PF, VF0 = "0000:01:00.0", "0000:01:00.1"
FAMILY_FUNCTIONS = {"pf": (PF,), "vf0": (VF0,)}
FAMILY_PARENTS = {"vf0": "pf"}
B = Claimant.parse("libvirt:b")  # claims the PF
SV = Claimant.parse("container:sv")  # shares the VF, preempted by libvirt:a's claim on it


def family_leases() -> Iterator[tuple[Lease, ...]]:
    """libvirt:a holds the VF exclusively (active, or releasing before and after the VF
    went home), having preempted container:sv's shared lease on it or not; libvirt:b
    holds the PF (shared, or exclusively in every state an acquire and a release pass
    through); container:sv shares the VF by itself."""
    steps = ((), (("pf", PLANNED),), (("pf", DONE),))
    a_shapes: list[Lease | None] = [None]
    for state, switched in ((ACTIVE, ()), (RELEASING, steps[1]), (RELEASING, steps[2])):
        switched = tuple(("vf0", step) for _, step in switched)
        for step in (None, DONE, STARTING):
            if step is STARTING and state is not RELEASING:
                continue
            records = () if step is None else (StoppedHolder(SV, step, ("vf0",), tokens=("vf0",)),)
            a_shapes.append(
                lease(A, EXCLUSIVE, ("vf0",), state, switched=switched, stopped=records)
            )
    b_shapes: list[Lease | None] = [None, lease(B, SHARED, ("pf",), ACTIVE)]
    for state, switched in [(ACQUIRING, s) for s in steps] + [
        (ACTIVE, ()),
        (RELEASING, steps[1]),
        (RELEASING, steps[2]),
    ]:
        b_shapes.append(lease(B, EXCLUSIVE, ("pf",), state, switched=switched))
    sv_shapes: list[Lease | None] = [None, lease(SV, SHARED, ("vf0",), ACTIVE)]
    for shapes_ in itertools.product(a_shapes, b_shapes, sv_shapes):
        yield tuple(x for x in shapes_ if x is not None)


def family_facts(vfio: frozenset[str], running: frozenset[Claimant], present: bool) -> HostFacts:
    drivers = {PF: VFIO if "pf" in vfio else "xe"}
    if present:
        drivers[VF0] = VFIO if "vf0" in vfio else "xe"
    return HostFacts(
        drivers, FAMILY_FUNCTIONS, {SV: SV in running}, frozenset({SV}), FAMILY_PARENTS
    )


def family_specs(vfio: frozenset[str], present: bool) -> list[TokenSpec]:
    pf = PciFunction(PF, "8086", "56c0", "030000", VFIO if "pf" in vfio else "xe", "4")
    vf = PciFunction(VF0, "8086", "56c1", "030000", VFIO if "vf0" in vfio else "xe", "5", physfn=PF)
    return [TokenSpec("pf", PF, (pf,)), TokenSpec("vf0", VF0, (vf,) if present else (), vf_of=PF)]


def family_cases() -> Iterator[tuple[LedgerState, frozenset[str], frozenset[Claimant], bool]]:
    """Each ledger with its host: the PF on vfio-pci only with no VF (vfio-pci does not
    take it otherwise), and only the states where I1-I3 hold."""
    for leases in family_leases():
        state = LedgerState(leases=leases)
        if not sane(state) or (
            state.lease_of(SV) and any(r.holder == SV for x in leases for r in x.unrestored())
        ):
            continue
        vfio = frozenset(t for t in FAMILY_FUNCTIONS if on_vfio(state, t))
        stopped = {r.holder for x in leases for r in x.unrestored() if r.state is not PLANNED}
        running = frozenset({SV} - stopped)
        for present in (True, False):
            if (present and "pf" in vfio) or (not present and "vf0" in vfio):
                continue
            if not violations(state, family_facts(vfio, running, present)):
                yield state, vfio, running, present


def family_release(
    state: LedgerState,
    vfio: frozenset[str],
    running: frozenset[Claimant],
    present: bool,
    claimant: Claimant,
    parents: dict[str, str] | None,
) -> list[str]:
    """Release `claimant` as core/releasing.py does, over the model host; every
    violation of I1-I3 after each step."""
    on, up = set(vfio), set(running)
    found: list[str] = []

    def check(label: str, now: LedgerState) -> LedgerState:
        problems = violations(now, family_facts(frozenset(on), frozenset(up), present))
        found.extend(f"after {label}: {p}" for p in problems)
        return now

    plan = decide_release(
        state, claimant, family_specs(vfio, present), me=ME, boot_id=BOOT, parents=parents
    )
    assert plan is not None
    now = check("intent", apply_intent(state, plan))
    if plan.lease is None:
        return found
    for step in plan.homes:
        if step.due and step.way is not HomeWay.UNKNOWN:
            on.discard(step.token)
            now = check(f"{step.token} home", apply_home(now, claimant, step.token))
    attempted: set[Claimant] = set()
    while (comeback := decide_comeback(now, claimant, attempted)) is not None:
        attempted.add(comeback.record.holder)
        now = apply_comeback(now, comeback)
        if comeback.way is ComebackWay.START:
            up.add(comeback.record.holder)
            home = {s.name for s in family_specs(frozenset(on), present) if s.functions}
            home -= on
            returned = decide_return(
                now, claimant, comeback.record, running=True, home=home, parents=parents
            )
            now = apply_return(now, comeback, returned, boot_id=BOOT, created="now")
        now = check(f"{comeback.record.holder} {comeback.way}", now)
    end = decide_end(now, claimant, attempted)
    check(f"end {end}", apply_end(now, claimant, end))
    return found


def test_every_release_keeps_a_vfs_lease_off_a_pf_held_exclusively():
    """Exhaustive over the PF's and the VF's leases (and a sharer of the VF preempted by
    the VF's exclusive claim, whose lease a release gives back): every release, I1 with
    its PF↔VF clause after every step.  A lease is never given back on a VF whose PF
    another lease holds exclusively (decide_return's last guard)."""
    cases = list(family_cases())
    assert len(cases) >= 40, len(cases)
    for state, vfio, running, present in cases:
        for item in state.leases:
            problems = family_release(state, vfio, running, present, item.claimant, FAMILY_PARENTS)
            assert not problems, (item.claimant, state, vfio, present, problems)


def test_without_the_relation_a_release_gives_a_vf_lease_back_under_its_pfs_exclusive_owner():
    """The same universe with decide_return not told the relation (the planted bug):
    some release breaks I1, so the check above can fail."""
    broken = [
        (state, item.claimant)
        for state, vfio, running, present in family_cases()
        for item in state.leases
        if family_release(state, vfio, running, present, item.claimant, None)
    ]
    assert broken, "no state shows the VF's lease given back under the PF's exclusive owner"
