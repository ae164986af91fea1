"""What starting a libvirt domain would do, before anyone starts it.

The claim is read from the domain's definition exactly as the hook reads it at
`prepare` (its <hostdev>s and the claim element), and planned by the same
`Arbiter.plan` as every claim, with the same preemption policy, so the preview
cannot disagree with the start.  `plan libvirt:NAME` with no mode and no
tokens uses it, and so does Cockpit's GPUs page.
"""

from __future__ import annotations

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.model import Claimant
from charly_arbiter.core.planner import ClaimPlan
from charly_arbiter.errors import UsageError, cli_command
from charly_arbiter.host.sysfs import HOST_ROOTS
from charly_arbiter.libvirt.domains import KIND, LibvirtHolders
from charly_arbiter.libvirt.domainxml import DomainClaim, mdev_parent, parse_domain, resolve_claim
from charly_arbiter.libvirt.hookrun import preemption_policy


def domain_claim(arbiter: Arbiter, name: str) -> DomainClaim | None:
    """The claim domain `name` makes when it starts (None: it claims no GPU)."""
    source = LibvirtHolders(arbiter.config)
    try:
        xml = source.definition(name)
    finally:
        source.close()
    if xml is None:
        raise UsageError(
            f"libvirt at {arbiter.config.libvirt_uri} has no domain named {name}",
            hint="`virsh list --all` lists the domains",
        )
    sys_root = HOST_ROOTS.sys
    return resolve_claim(
        parse_domain(xml, name),
        arbiter.tokens.token_for_address,
        lambda uuid: mdev_parent(sys_root, uuid),
    )


def preview_start(arbiter: Arbiter, claimant: str) -> ClaimPlan | None:
    """The plan of starting `claimant` (libvirt:NAME); None when it claims no GPU."""
    ref = Claimant.parse(claimant)
    if ref.kind != KIND:
        raise UsageError(
            f"{claimant} is not a libvirt domain: only a domain's definition says what it claims",
            hint="name the mode and the tokens: "
            + cli_command("plan", "--exclusive", operands=[ref, "TOKEN"]),
        )
    claim = domain_claim(arbiter, ref.name)
    if claim is None:
        return None
    return arbiter.plan(
        claimant,
        claim.mode,
        list(claim.tokens),
        transient=claim.transient,
        policy=preemption_policy(arbiter.config),
    )
