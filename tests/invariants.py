"""The safety invariants of docs/architecture.md, as checks every test can share.

(I1) A token never has an exclusive lease beside any other lease that holds it,
     and no PCI function is held exclusively under one token name beside a lease
     on another token that has it too (tokens never overlap).  A lease on a token
     on an SR-IOV virtual function is a use of its physical function's token: no
     other lease holds that one exclusively meanwhile.
(I2) A token's functions are on vfio-pci only while an exclusive lease covers it
     (in any state), it is poisoned, or its recorded home is vfio-pci (bound
     there on purpose: `adopt --admin`).  An NVIDIA vGPU VF with a vGPU type is
     given to a VM as one on vfio-pci is: the same holds for its type.
(I3) Every holder the arbiter stopped is recorded in exactly one lease until it
     is started again.
(I4) A mutating command on a corrupt or unsafe ledger changes nothing on the
     host or on disk (`unchanged_by`).
(I5) Once every claimant is gone, `restore --stranded` leaves no lease, every
     token home or poisoned, every preemptible holder running, no sleep lock, and
     a second restore changes nothing (`assert_converged`).
(I6) Every sleep lock (logind inhibitor) the host holds for a token is recorded by
     exactly one lease, which holds that token and is the one the lock names: a
     lock is recorded before it is taken and forgotten only once it is let go, so
     that a crash at any step leaves `restore` every lock it must let go of.

The checks read plain facts (the ledger's state, each function's driver, which
holders run), so the simulated host, a real libvirtd and a real kernel can all
be checked by the same code.  They return every violation, not the first one,
so a failing interleaving says everything that went wrong at that step.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from charly_arbiter.core.model import VFIO, LedgerState, Mode, blocks_token

T = TypeVar("T")


@dataclass(frozen=True)
class HostFacts:
    """What the host shows at one moment.

    `expected_running` are the holders that run unless the arbiter stopped
    them (those running when the test began, less what the test stopped by
    itself and holders that cannot come back, such as a terminated process).
    """

    drivers: Mapping[str, str | None]
    token_functions: Mapping[str, Sequence[str]]
    running: Mapping[str, bool]
    expected_running: frozenset[str] = field(default_factory=frozenset)
    # token on a virtual function -> the token of its physical function
    parents: Mapping[str, str] = field(default_factory=dict)
    # address -> the vGPU type of an NVIDIA vGPU VF (0: none)
    vgpu_types: Mapping[str, int] = field(default_factory=dict)
    # token -> why, the sleep locks the host holds (`Host.inhibitors`)
    sleep_locks: Mapping[str, str] = field(default_factory=dict)


def violations(state: LedgerState, host: HostFacts) -> list[str]:
    """Every way in which I1, I2 or I3 does not hold."""
    found: list[str] = []
    for token in host.token_functions:
        holding = [lease for lease in state.leases if blocks_token(lease, token)]
        exclusive = [lease for lease in holding if lease.mode is Mode.EXCLUSIVE]
        if exclusive and len(holding) > 1:
            names = ", ".join(f"{item.claimant} ({item.mode}, {item.state})" for item in holding)
            found.append(f"I1: {token} is held exclusively beside another lease: {names}")
    for lease in state.leases:
        for vf in lease.tokens:
            pf = host.parents.get(vf)
            if pf is None or not blocks_token(lease, vf):
                continue
            for other in state.leases:
                if (
                    other.claimant != lease.claimant
                    and other.mode is Mode.EXCLUSIVE
                    and blocks_token(other, pf)
                ):
                    found.append(
                        f"I1: {pf} is held exclusively by {other.claimant} ({other.state}) while "
                        f"{lease.claimant} ({lease.mode}, {lease.state}) holds its VF {vf}"
                    )
    owners: dict[str, set[tuple[str, str]]] = {}
    for lease in state.leases:
        for token in lease.tokens:
            if blocks_token(lease, token):
                for address in host.token_functions.get(token, ()):
                    owners.setdefault(address, set()).add((lease.claimant, token))
    for address, held in sorted(owners.items()):
        by = {claimant for claimant, _ in held}
        exclusive = [c for c in by if (lease := state.lease_of(c)) and lease.mode is Mode.EXCLUSIVE]
        if exclusive and len(by) > 1 and len({token for _, token in held}) > 1:
            names = ", ".join(f"{claimant} ({token})" for claimant, token in sorted(held))
            found.append(f"I1: {address} is held exclusively beside another lease: {names}")
    for token, addresses in host.token_functions.items():
        on_vfio = [
            address
            for address in addresses
            if host.drivers.get(address) == VFIO or host.vgpu_types.get(address)
        ]
        if not on_vfio or state.poison_of(token) is not None:
            continue
        if all(state.home_of(token).get(address) == VFIO for address in on_vfio):
            continue
        # Covered by an exclusive lease on a token that has these functions (by name or,
        # where tokens overlap, under another name).
        covering = {
            name
            for name, functions in host.token_functions.items()
            if set(on_vfio) & set(functions)
        }
        covered = any(
            lease.mode is Mode.EXCLUSIVE and covering & set(lease.tokens) for lease in state.leases
        )
        if not covered:
            found.append(
                f"I2: {token} has {', '.join(on_vfio)} on vfio-pci with no exclusive lease "
                "and no poison"
            )
    records: dict[str, list[str]] = {}
    for lease in state.leases:
        for record in lease.stopped:
            if not record.restored:
                records.setdefault(same_unit(record.holder), []).append(lease.claimant)
    for holder, leases in sorted(records.items()):
        if len(leases) > 1:
            found.append(f"I3: {holder} is recorded as stopped by {len(leases)} leases: {leases}")
    for holder in sorted(host.expected_running):
        if not host.running.get(holder, False) and same_unit(holder) not in records:
            found.append(f"I3: {holder} is stopped, and no lease records it")
    found += sleep_lock_violations(state, host.sleep_locks)
    return found


def sleep_lock_violations(state: LedgerState, locks: Mapping[str, str]) -> list[str]:
    """Every way in which I6 does not hold, for the host's locks (token -> why)."""
    found: list[str] = []
    recorders: dict[str, list[str]] = {}
    for lease in state.leases:
        for token in lease.sleep_locks:
            recorders.setdefault(token, []).append(lease.claimant)
            if not blocks_token(lease, token):
                found.append(
                    f"I6: {lease.claimant} ({lease.state}) records {token}'s sleep lock "
                    "but no longer holds it"
                )
    for token, claimants in sorted(recorders.items()):
        if len(claimants) > 1:
            found.append(f"I6: {token}'s sleep lock is recorded by {len(claimants)} leases")
    for token, why in sorted(locks.items()):
        claimants = recorders.get(token, [])
        if not claimants:
            found.append(
                f"I6: the host holds {token}'s sleep lock ({why}), and no lease records it"
            )
        elif why != f"{token} is passed through to {claimants[0]}":
            found.append(f"I6: {token}'s sleep lock says {why!r}, but {claimants[0]} records it")
    return found


def same_unit(holder: str) -> str:
    """One name for one unit: a display manager (`display-manager:UNIT`, issue 19's
    `screen = "release"`) is the system unit `systemd:UNIT` a host may list as a holder
    too, whichever name a lease recorded it by."""
    kind, _, name = holder.partition(":")
    return f"systemd:{name}" if kind == "display-manager" else holder


def assert_invariants(state: LedgerState, host: HostFacts, context: object = "") -> None:
    problems = violations(state, host)
    assert not problems, f"{context}: " + "; ".join(problems) if context else "; ".join(problems)


def unchanged_by(snapshot: Callable[[], T], action: Callable[[], object]) -> tuple[T, T]:
    """(I4) The snapshot before and after `action`; the caller asserts they are equal."""
    before = snapshot()
    action()
    return before, snapshot()


def assert_converged(
    state: LedgerState,
    host: HostFacts,
    homes: Mapping[str, str | None],
    preemptible: Collection[str],
) -> None:
    """(I5) No lease, every function home (or its token poisoned), every preemptible
    holder that is expected to run running."""
    assert state.leases == (), state.leases
    for token, addresses in host.token_functions.items():
        if state.poison_of(token) is not None:
            continue
        for address in addresses:
            assert host.drivers.get(address) == homes[address], (token, address, host.drivers)
    for holder in sorted(preemptible):
        if holder in host.expected_running:
            assert host.running.get(holder, False), (holder, host.running)
    assert not host.sleep_locks, host.sleep_locks
    assert_invariants(state, host, "after restore")


def sim_facts(
    snapshot: Mapping[str, object],
    token_functions: Mapping[str, Sequence[str]],
    expected_running: Collection[str],
    parents: Mapping[str, str] | None = None,
) -> HostFacts:
    """HostFacts from a simulated host's `snapshot()`."""
    drivers = snapshot["drivers"]
    running = snapshot["running"]
    vfs = snapshot.get("vfs", {})
    assert isinstance(drivers, dict) and isinstance(running, dict) and isinstance(vfs, dict)
    return HostFacts(
        drivers={address: driver or None for address, driver in drivers.items()},
        token_functions=token_functions,
        running={ref: bool(value) for ref, value in running.items()},
        expected_running=frozenset(expected_running),
        parents=parents or {},
        vgpu_types={address: int(vf.get("vgpu", 0)) for address, vf in vfs.items()},
        sleep_locks=dict(snapshot.get("sleep_locks", {})),  # type: ignore[call-overload]
    )
