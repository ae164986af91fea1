"""Who is still there: the writer of an unfinished lease, a lease's claimant.

A lease is **stranded** when nothing will ever end it by itself: it was
written before the last boot, the process carrying it out died half-way, or
its claimant (a VM, a process) no longer runs.  `restore --stranded` ends
exactly these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import datetime

from charly_arbiter.core.host import Host
from charly_arbiter.core.model import Claimant, Lease, LeaseState, LedgerState, ProcessRef


def claimant_liveness(host: Host, state: LedgerState | None, boot_id: str) -> dict[Claimant, bool]:
    """Whether each active lease's claimant runs; asked before taking the lock,
    because the answer may come from libvirt, whose hooks call back in here."""
    if state is None:
        return {}
    asked = [
        lease.claimant
        for lease in state.leases
        if lease.state is LeaseState.ACTIVE and lease.boot_id == boot_id and not lease.is_operation
    ]
    return host.are_running(asked) if asked else {}


def stranded_claimants(
    state: LedgerState,
    boot_id: str,
    *,
    grace: float,
    process_alive: Callable[[ProcessRef], bool],
    alive: Mapping[Claimant, bool],
) -> frozenset[Claimant]:
    """Leases from an earlier boot, of a dead writer, or of a claimant gone.

    The writer of an acquiring or releasing lease is known by pid and start
    time: a zombie, or another process that got its pid, is not it.

    The arbiter's own operations (`arbiter:vfs/gpu0`) are their writer: stranded
    once it is gone, in any state.

    A claimant may not run yet within `grace` seconds of its claim (a VM
    between its prepare hook and its start).  `alive` says whether each
    claimant runs (asked in one pass, before the lock); a claimant it does not
    know (a lease written meanwhile) counts as running, so the lock is never
    held across a question to libvirt.
    """
    stranded: set[Claimant] = set()
    for lease in state.leases:
        if lease.boot_id != boot_id:
            stranded.add(lease.claimant)
        elif lease.state is not LeaseState.ACTIVE or lease.is_operation:
            owner = lease.owner
            if owner is None or not process_alive(owner):
                stranded.add(lease.claimant)
        elif _young(lease, grace):
            continue
        elif not alive.get(lease.claimant, True):
            stranded.add(lease.claimant)
    return frozenset(stranded)


def not_running_yet(
    state: LedgerState, boot_id: str, *, grace: float, alive: Mapping[Claimant, bool]
) -> dict[Claimant, float]:
    """Claimants that do not run but are not stranded, because their claim is younger
    than `grace`: each with its claim's age in seconds.  What `restore --stranded`
    names when it finds nothing, so that "nothing to restore" right after a VM's stop
    is not mistaken for a lease that will never end."""
    waiting: dict[Claimant, float] = {}
    for lease in state.leases:
        if lease.boot_id != boot_id or lease.state is not LeaseState.ACTIVE:
            continue
        if lease.is_operation or alive.get(lease.claimant, True):
            continue
        age = _age(lease)
        if age is not None and age < grace:
            waiting[lease.claimant] = max(age, 0.0)
    return waiting


def _young(lease: Lease, grace: float) -> bool:
    age = _age(lease)
    return age is not None and age < grace


def _age(lease: Lease) -> float | None:
    try:
        return time.time() - datetime.fromisoformat(lease.created).timestamp()
    except ValueError:
        return None


def claimant_runs(host: Host, lease: Lease) -> bool:
    """Whether the lease's claimant runs: asked of the host, but for the arbiter's own
    operations, whose claimant is the process that carries them out."""
    if lease.is_operation:
        owner = lease.owner
        return owner is not None and host.process_alive(owner)
    return host.is_running(lease.claimant)
