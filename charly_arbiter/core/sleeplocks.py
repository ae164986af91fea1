"""Sleep locks: which logind inhibitor locks the leases need, and how the host's
locks are brought to that (pure).

While a GPU is passed through, the host must not suspend: the VM would lose its
GPU (vfio-pci does not carry a passed-through device through a suspend).  So an
active exclusive lease holds, for each of its tokens, a lock of what=sleep,
mode=block, who=charly-arbiter, saying why: "gpu0 is passed through to
libvirt:win11" (`Host.inhibit`).  The arbiter's own operations (a VF count, a MIG
change) hold none: nothing is passed through.  `sleep = "allow"` holds none at all.

The lease records a lock before it is taken and forgets it only once it is let go
(`Lease.sleep_locks`), as it records a holder before stopping it: so every lock
the host holds is recorded by the one lease that holds its token (I6 of
tests/invariants.py), whatever step a kill -9 interrupts, and `restore` finds
what is left over.  A lease takes its locks once its GPUs are on vfio-pci, just
before it turns active, and lets go of them as its release begins, before its
tokens go home (a token recorded by a lease is never held by another).

`decide_sleep_locks` is what `restore` converges to: the locks the active
exclusive leases need, each saying its own why; a lock nobody needs is let go,
unless the lease recording it is being carried out by a live process (its
claim takes it, or its release lets it go, in a moment).  A lock no lease records
at all (none of the arbiter's steps leaves one: I6) is let go as nobody's; one a
claim beginning at that very moment takes for the same token could be let go with
it, which the next `restore` puts right.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from charly_arbiter.core.model import (
    Claimant,
    LeaseState,
    LedgerState,
    Mode,
    SleepPolicy,
)


def lock_why(token: str, claimant: str) -> str:
    """What the lock says (systemd-inhibit --list's WHY)."""
    return f"{token} is passed through to {claimant}"


def blocks_sleep(mode: Mode, claimant: Claimant, policy: SleepPolicy) -> bool:
    """Whether a lease of this mode and claimant holds sleep locks while active."""
    return (
        policy is SleepPolicy.BLOCK
        and mode is Mode.EXCLUSIVE
        and claimant.kind != "arbiter"  # the arbiter's own operations pass nothing through
    )


def wanted(state: LedgerState, policy: SleepPolicy) -> dict[str, str]:
    """token -> why, for every lock the leases need now: one per token of an active
    exclusive lease (none with `sleep = "allow"`)."""
    return {token: lock_why(token, claimant) for token, claimant in _needing(state, policy).items()}


def recorded(state: LedgerState) -> dict[str, Claimant]:
    """token -> the lease that records its lock."""
    return {token: lease.claimant for lease in state.leases for token in lease.sleep_locks}


def with_recorded(state: LedgerState, claimant: Claimant, tokens: Collection[str]) -> LedgerState:
    """The claimant's lease recording the locks of `tokens` (before they are taken)."""
    lease = state.lease_of(claimant)
    if lease is None:
        return state
    merged = tuple(sorted({*lease.sleep_locks, *tokens}))
    return state.with_lease(replace(lease, sleep_locks=merged, sleep_lock_error=""))


def with_failure(state: LedgerState, claimant: Claimant, why: str) -> LedgerState:
    """The claimant's lease saying why its locks could not be taken."""
    lease = state.lease_of(claimant)
    if lease is None:
        return state
    return state.with_lease(replace(lease, sleep_lock_error=why))


def forgotten(
    state: LedgerState, tokens: Collection[str], claimant: str | None = None
) -> LedgerState:
    """Every lease (or the claimant's alone) no longer recording the locks of `tokens`
    (after they were let go)."""
    for lease in state.leases:
        if claimant is not None and lease.claimant != claimant:
            continue
        kept = tuple(token for token in lease.sleep_locks if token not in tokens)
        if kept != lease.sleep_locks:
            state = state.with_lease(replace(lease, sleep_locks=kept))
    return state


@dataclass(frozen=True)
class SleepLockPlan:
    """What brings the host's locks to what the leases need."""

    # (token, why, the lease that needs it): locks to take, or to take again where the
    # host's says another why (a lock left by an earlier lease on the token)
    take: tuple[tuple[str, str, Claimant], ...] = ()
    let_go: tuple[str, ...] = ()  # tokens whose lock nobody needs
    # tokens recorded by a lease that holds no lock for them and needs none
    forget: tuple[str, ...] = ()
    # (token, the lease that needs it): locks held as needed that it does not record
    record: tuple[tuple[str, Claimant], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.take or self.let_go or self.forget or self.record)


def decide_sleep_locks(
    state: LedgerState,
    policy: SleepPolicy,
    held: Mapping[str, str],
    busy: Collection[Claimant] = (),
) -> SleepLockPlan:
    """The changes that make the host's locks (`held`: token -> why) what the leases
    need.  `busy` are the claimants whose lease a live process is carrying out: the
    locks they record (or their tokens' locks) are theirs to take or let go."""
    need = wanted(state, policy)
    owners = _needing(state, policy)
    records = recorded(state)
    untouchable = {
        token
        for lease in state.leases
        if lease.claimant in busy
        for token in (*lease.tokens, *lease.sleep_locks)
    }
    take = tuple(
        (token, why, owners[token])
        for token, why in sorted(need.items())
        if held.get(token) != why and token not in untouchable
    )
    let_go = tuple(
        token for token in sorted(held) if token not in need and token not in untouchable
    )
    forget = tuple(
        token
        for token in sorted(records)
        if token not in need and token not in held and token not in untouchable
    )
    record = tuple(
        (token, owners[token])
        for token, why in sorted(need.items())
        if held.get(token) == why
        and records.get(token) != owners[token]
        and token not in untouchable
    )
    return SleepLockPlan(take, let_go, forget, record)


def _needing(state: LedgerState, policy: SleepPolicy) -> dict[str, Claimant]:
    """token -> the active exclusive lease that needs its lock."""
    return {
        token: lease.claimant
        for lease in state.leases
        if lease.state is LeaseState.ACTIVE and blocks_sleep(lease.mode, lease.claimant, policy)
        for token in lease.tokens
    }
