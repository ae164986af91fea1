"""A physical function's VF count, set by the arbiter: `vfs TOKEN N` and, at boot,
every count arbiter.toml configures (`vfs = N` on a token; counts do not survive a
reboot).

Decided under the ledger lock on the state read under it (`vfs.decide_count`),
its lease (`arbiter:vfs/TOKEN`, a shared use of the PF on its driver) written
before the first write, so that claims on the PF's VFs and on the PF itself
wait meanwhile, and a crash leaves a stranded lease for `restore`.  Each write
of `sriov_numvfs` is the host's, by its write helper under the watchdog; one
that hangs is stuck in the kernel until the process that holds a VF's VFIO
device lets go, and no timeout or signal can end it: the PF is poisoned, with
the holders the host sees and what to do, and nothing claims it or its VFs
until an operator has cleared it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.crashpoints import crashpoint
from charly_arbiter.core.events import EventKind
from charly_arbiter.core.host import DeviceUser, TokenSpec
from charly_arbiter.core.model import Poison, now, operation_claimant
from charly_arbiter.core.tokens import vf_specs
from charly_arbiter.core.vfs import decide_count
from charly_arbiter.errors import (
    ArbiterError,
    VfCountFailed,
    VfCountHung,
    cli_command,
    signal_name,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CountDone:
    """What a change of the count did: from how many to how many, the seconds each
    write took (empty: it had that count already)."""

    token: str
    before: int
    count: int
    seconds: tuple[float, ...] = ()


def set_vf_count(arbiter: Arbiter, token_name: str, count: int) -> CountDone:
    """Set the token's VF count (through 0), or raise why not: `VfCountInvalid` (2),
    `VfCountRefused` (3), `VfCountFailed` (1; `VfCountHung` poisons the token)."""
    ours = operation_claimant("vfs", token_name)
    arbiter.refuse_contradictions([token_name])
    spec = arbiter.tokens.reread([token_name])[0]
    # Outside the lock: a scan of /proc, and (for a VF on vfio-pci) its group's node.
    users = arbiter.host.device_users(vf_specs(arbiter.host, spec.virtual_functions))
    boot_id = arbiter.host.boot_id()
    with arbiter.ledger.transaction() as txn:
        plan = decide_count(
            txn.state,
            spec,
            count,
            parents=arbiter.tokens.parents(),
            coverage=arbiter.tokens.addresses(),
            vf_users=users,
            me=arbiter.owner,
            boot_id=boot_id,
            stranded=arbiter.stranded_claimants(txn.state),
            created=now(),
        )
        if plan is None:
            before = count
        else:
            before = plan.before
            txn.state = txn.state.with_lease(plan.lease)
    if plan is None:
        return CountDone(token_name, before, count)
    arbiter.events.emit(
        EventKind.VF_COUNT, claimant=ours, token=token_name, count=count, before=before
    )
    crashpoint("vfs.intent")
    seconds: list[float] = []
    try:
        for written in plan.writes:
            started = time.monotonic()
            crashpoint("vfs.write")
            arbiter.host.write_vf_count(plan.address, written)
            seconds.append(round(time.monotonic() - started, 3))
    except VfCountHung as hung:
        _poison(arbiter, spec, plan.address, hung, ours)
        raise
    except VfCountFailed as failed:
        _end(arbiter, ours)
        failed.hint = f"the kernel refused it; {cli_command('detect')} shows the PF and its VFs" + (
            f" ({len(seconds)} of {len(plan.writes)} writes were made)" if seconds else ""
        )
        raise
    except KeyboardInterrupt as interrupt:
        # Cut short by a signal (Ctrl-C on a write that hangs): whether it went
        # through, or is stuck in the kernel still, nobody knows.
        reason = (
            f"its VF count change to {count} was interrupted by {signal_name(interrupt)} "
            "before it returned; how many VFs it has is not known"
        )
        with arbiter.ledger.transaction() as txn:
            txn.state = txn.state.without_lease(ours).with_poison(spec.name, Poison(reason, now()))
        arbiter.events.emit(EventKind.POISONED, token=spec.name, claimant=ours, why=reason)
        raise
    except BaseException:
        _end(arbiter, ours)
        raise
    _end(arbiter, ours)
    arbiter.events.emit(
        EventKind.VF_COUNTED, claimant=ours, token=token_name, count=count, seconds=sum(seconds)
    )
    return CountDone(token_name, before, count, tuple(seconds))


def apply_configured(arbiter: Arbiter) -> list[tuple[str, CountDone | ArbiterError]]:
    """Every count arbiter.toml configures (`vfs = N`), each on its own: what the
    reconcile unit runs at boot, after `restore --stranded`."""
    done: list[tuple[str, CountDone | ArbiterError]] = []
    for token in arbiter.config.tokens:
        if token.vfs is None:
            continue
        try:
            done.append((token.name, set_vf_count(arbiter, token.name, token.vfs)))
        except ArbiterError as error:
            log.error("%s: %s", token.name, error)
            done.append((token.name, error))
    return done


def _end(arbiter: Arbiter, ours: str) -> None:
    with arbiter.ledger.transaction() as txn:
        txn.state = txn.state.without_lease(ours)


def _poison(arbiter: Arbiter, spec: TokenSpec, address: str, hung: VfCountHung, ours: str) -> None:
    """The write is stuck in the kernel: poison the PF (its lease goes in the same
    transaction) with who holds its VFs, as far as the host can see."""
    holders = _holders(arbiter, spec)
    named = "; ".join(str(user) for user in holders) or (
        "no process the arbiter can see (look for a VM or a program with /dev/vfio/* open)"
    )
    reason = (
        f"writing {hung.count} to {address}/sriov_numvfs hung: the kernel waits for a VF's "
        f"VFIO device to be let go ({named}); the watchdog cannot end a write stuck in the "
        "kernel, only its holder can"
    )
    with arbiter.ledger.transaction() as txn:
        txn.state = txn.state.without_lease(ours).with_poison(spec.name, Poison(reason, now()))
    arbiter.events.emit(EventKind.POISONED, token=spec.name, claimant=ours, why=reason)
    hung.hint = (
        f"{spec.name} is poisoned now: stop the holder of its VF's VFIO device"
        + (f" ({', '.join(f'pid {user.pid}' for user in holders)})" if holders else "")
        + ", wait until the write returns (the VFs are gone from `ls "
        f"/sys/bus/pci/devices/{address}/`), then run "
        + cli_command("poison", "clear", operands=[spec.name])
    )


def _holders(arbiter: Arbiter, spec: TokenSpec) -> Sequence[DeviceUser]:
    """Who has a node of the PF's VFs open, VFs a stuck teardown left half-way included
    (their `virtfnN` links are gone, their devices are not)."""
    pf = next((f for f in spec.functions if f.address == spec.address), None)
    if pf is None or pf.sriov is None:
        return []
    try:
        return arbiter.host.device_users(vf_specs(arbiter.host, pf.sriov.possible(pf.address)))
    except ArbiterError as error:
        log.warning("%s: cannot scan for the holders of its VFs: %s", spec.name, error)
        return []
