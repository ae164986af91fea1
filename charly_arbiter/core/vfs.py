"""The rules between a physical function and its virtual functions (SR-IOV), pure.

A virtual function is a device of its own for the IOMMU and for the VM that
gets it, but it lives on its physical function: the PF's driver made it, a
reset or a switch of the PF takes it away, and the PF cannot leave for vfio-pci
while it has VFs.  So a lease on a VF token is a shared use of its PF on the
PF's home driver, and the planner treats it as one: a claim on a VF is refused
while its PF is held exclusively (or poisoned, or its VF count is changing),
and an exclusive claim on the PF is refused while any of its VFs is leased or
open, naming them.  Shared claims on the PF go on beside the VFs' leases, as
shared claims do beside each other.

The relation is not recorded in the ledger: it is a fact of the hardware (a
VF's address is its PF's plus `sriov_offset` plus `sriov_stride` times its
index, known whether the VF exists or not), read by the catalogue from the
configuration and sysfs each time (`TokenCatalogue.physical_functions`), and
handed to the planner as pure input.  So there is no second record to keep in
step with the VF's lease through preemption, hand-over, release and restore,
and no crash can leave the two disagreeing: the VF's lease is the whole truth,
and I1-I5 keep their meaning (I1 gains that no token is held exclusively while
a lease holds one of its VFs).

The VF count is the arbiter's too (`decide_count`): a change goes through 0 (the
kernel refuses any other change while VFs exist), is refused while a VF is
leased or open, and is carried out under a lease of the arbiter's own
(`arbiter:vfs/TOKEN`, a shared use of the PF on its driver, in progress for as
long as the write runs), which keeps claims on the PF's VFs waiting meanwhile
and a second change out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from charly_arbiter.core.host import DeviceUser, TokenSpec, sriov_enabled_why
from charly_arbiter.core.model import (
    VFIO,
    Claimant,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    ProcessRef,
    blocks_token,
    human_time,
    operation_claimant,
)
from charly_arbiter.errors import (
    ClaimRefused,
    PassthroughImpossible,
    VfCountInvalid,
    VfCountRefused,
    cli_command,
)


def leased_vfs(
    ledger: LedgerState,
    token: TokenSpec,
    claimant: Claimant,
    parents: Mapping[str, str],
    coverage: Mapping[str, Collection[str]],
) -> list[tuple[str, bool]]:
    """What holds a virtual function of `token` in the ledger, said for a person, and
    whether it will let go by itself soon: a lease (`0000:01:00.1 (token vf0) is leased
    by libvirt:vm (exclusive)`), or a shared claimant a release is about to give its
    VF lease back (soon)."""
    found = []
    for lease in ledger.leases:
        if lease.claimant == claimant:
            continue
        for name in lease.tokens:
            if parents.get(name) == token.name and blocks_token(lease, name):
                where = ", ".join(sorted(coverage.get(name, ()))) or name
                said = f"{where} (token {name}) is leased by {lease.claimant} ({lease.mode})"
                found.append((said, False))
        for record in lease.unrestored():
            for name in record.shared_tokens:
                if parents.get(name) == token.name and record.holder != claimant:
                    said = (
                        f"{record.holder} gets its lease on {name} back once "
                        f"{lease.claimant} has let go of it"
                    )
                    found.append((said, True))
    return found


def refuse_by_relation(
    ledger: LedgerState,
    claimant: Claimant,
    mode: Mode,
    tokens: Sequence[TokenSpec],
    *,
    parents: Mapping[str, str],
    coverage: Mapping[str, Collection[str]],
    vf_users: Sequence[DeviceUser] = (),
    in_place: bool = False,
) -> None:
    """Raise the `ClaimRefused` the PF↔VF rules give this claim, if any.

    `parents` maps each token on a VF to its PF's token; `vf_users` are the
    processes that have a node of one of the claimed tokens' VFs open (their
    `token` is the VF's address).  `in_place` is an exclusive claim that leaves
    the GPU on its driver (it may keep its VFs, never while one is in use)."""
    for token in tokens:
        _refuse_vf_claim(ledger, claimant, token, parents.get(token.name, ""))
    if mode is not Mode.EXCLUSIVE:
        return
    for token in tokens:
        busy = leased_vfs(ledger, token, claimant, parents, coverage)
        mine = {f.address for f in token.functions}
        busy += [(f"{u.token} is open: {u}", False) for u in vf_users if u.token not in mine]
        if busy:
            raise ClaimRefused(
                token.label,
                claimant,
                f"its virtual functions are in use: {'; '.join(said for said, _ in busy)}",
                hint="stop what uses them first (a VM's or a container's stop ends its lease); "
                "the physical function is not taken from under its virtual functions",
                retry=all(soon for _, soon in busy),
            )
        if token.virtual_functions and not in_place:
            raise PassthroughImpossible(
                token.label,
                claimant,
                sriov_enabled_why(len(token.virtual_functions)).split(";")[0]
                + f": {', '.join(token.virtual_functions)}",
                f"remove them first: {cli_command('vfs', operands=[token.name, '0'])}",
            )


def _refuse_vf_claim(ledger: LedgerState, claimant: Claimant, token: TokenSpec, owner: str) -> None:
    """A claim on a VF: refused while the VF does not exist, and while its PF's token
    (`owner`, "" when the PF is no token) is poisoned or held exclusively."""
    pf = token.physical_function
    if pf is None:
        return
    grow = (
        f"raise the VF count of {owner}: {cli_command('vfs', operands=[owner, 'N'])}"
        if owner
        else f"raise the VF count of {pf} (its sriov_numvfs)"
    )
    poison = ledger.poison_of(owner) if owner else None
    if poison is not None:
        raise ClaimRefused(
            token.label,
            claimant,
            f"its physical function {pf} (token {owner}) is poisoned since "
            f"{human_time(poison.since)} ({poison.reason})",
            hint="check the GPU and its driver by hand, then run "
            + cli_command("poison", "clear", operands=[owner]),
        )
    for lease in ledger.leases_on(owner) if owner else ():
        if lease.claimant == claimant or not blocks_token(lease, owner):
            continue
        if lease.claimant == operation_claimant("vfs", owner):
            raise ClaimRefused(
                token.label,
                claimant,
                f"the VF count of its physical function {pf} (token {owner}) is being changed",
                hint="try again once the change is done; if no `vfs` command runs, run "
                + cli_command("restore", "--stranded"),
                retry=True,
            )
        if lease.mode is Mode.EXCLUSIVE:
            raise ClaimRefused(
                token.label,
                claimant,
                f"its physical function {pf} (token {owner}) is held exclusively by "
                f"{lease.claimant}",
                hint=f"stop {lease.claimant} first, or wait until it releases {owner}",
            )
    if token.absent:
        raise ClaimRefused(
            token.label,
            claimant,
            f"it is a virtual function of {pf} that does not exist now",
            hint=grow,
        )


@dataclass(frozen=True)
class CountPlan:
    """A change of a physical function's VF count, decided: the writes of
    `sriov_numvfs` it takes (through 0 when VFs exist), and its lease, written
    before the first write."""

    token: str
    address: str
    before: int
    count: int
    writes: tuple[int, ...]
    lease: Lease


def decide_count(
    ledger: LedgerState,
    token: TokenSpec,
    count: int,
    *,
    parents: Mapping[str, str],
    coverage: Mapping[str, Collection[str]],
    vf_users: Sequence[DeviceUser],
    me: ProcessRef,
    boot_id: str,
    stranded: Collection[Claimant],
    created: str,
) -> CountPlan | None:
    """Decide setting `token`'s VF count to `count`: a plan, None when it has that
    count already, `VfCountInvalid` (exit 2) for a token that cannot, or the
    `VfCountRefused` (exit 3) that says why not now."""
    pf = next((f for f in token.functions if f.address == token.address), None)
    if pf is None or pf.sriov is None:
        raise VfCountInvalid(token.name, f"{token.address} is not an SR-IOV physical function")
    if count > pf.sriov.total_vfs:
        raise VfCountInvalid(
            token.name, f"{token.address} can have at most {pf.sriov.total_vfs} VFs, not {count}"
        )

    def refused(why: str, hint: str | None = None, *, retry: bool = False) -> VfCountRefused:
        return VfCountRefused(token.name, count, why, hint, retry=retry)

    poison = ledger.poison_of(token.name)
    if poison is not None:
        raise refused(
            f"{token.name} is poisoned since {human_time(poison.since)} ({poison.reason})",
            "check it by hand, then run " + cli_command("poison", "clear", operands=[token.name]),
        )
    ours = operation_claimant("vfs", token.name)
    running = ledger.lease_of(ours)
    if running is not None:
        if ours in stranded:
            raise refused(
                "an earlier change of its count did not finish (its process is gone)",
                f"run {cli_command('restore', operands=[ours])}, then try again",
            )
        owner = running.owner
        raise refused(
            f"another change of its count is under way (pid {owner.pid if owner else '?'})",
            "try again once it is done",
            retry=True,
        )
    for lease in ledger.leases_on(token.name):
        if lease.mode is Mode.EXCLUSIVE and blocks_token(lease, token.name):
            raise refused(
                f"{token.name} is held exclusively by {lease.claimant}",
                f"stop {lease.claimant} first",
            )
    if pf.driver in (None, VFIO):
        raise refused(
            f"{token.address} is {'on vfio-pci' if pf.driver else 'bound to no driver'}: the "
            "kernel changes the count through the physical function's own driver",
            f"bring it home first ({cli_command('status')} shows what holds it)",
        )
    busy = leased_vfs(ledger, token, ours, parents, coverage)
    busy += [(f"{user.token} is open: {user}", False) for user in vf_users]
    if busy:
        raise refused(
            f"its virtual functions are in use: {'; '.join(said for said, _ in busy)}",
            "stop what uses them first: the count can only change through 0, which "
            "removes every VF",
            retry=all(soon for _, soon in busy),
        )
    before = pf.sriov.num_vfs
    if count == before:
        return None
    writes = (0, count) if before and count else (count,)
    lease = Lease(
        claimant=ours,
        mode=Mode.SHARED,
        tokens=(token.name,),
        state=LeaseState.ACQUIRING,
        transient=True,
        boot_id=boot_id,
        created=created,
        note=f"its VF count {before} -> {count}",
    ).owned_by(me)
    return CountPlan(token.name, token.address, before, count, writes, lease)
