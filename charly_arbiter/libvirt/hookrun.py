"""The hook's slow path: a domain whose XML may claim a GPU.

`hook.py` decides, from a byte scan, that the domain may claim; everything
after that is here, with ordinary imports and types.  libvirt holds the
domain locked until the hook exits, so while it runs a marker says so (other
arbiter processes then never wait on that lock).  The release of a claim that
stopped holders is the session's (`hooksession.HookSession.stopped`): handed to a
detached process, after the lease has turned `releasing` under the lock.
"""

from __future__ import annotations

import logging

from charly_arbiter.compose import token_catalogue
from charly_arbiter.core.config import Config, load_config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant, HolderKind, Mode, Preemption
from charly_arbiter.core.planner import NO_POLICY, Policy
from charly_arbiter.errors import InvalidClaimant, Refused, cli_command
from charly_arbiter.hooksession import HookSession
from charly_arbiter.host.markers import HOOK_DIR, marked
from charly_arbiter.host.sysfs import HOST_ROOTS
from charly_arbiter.libvirt.domainxml import (
    DomainClaim,
    DomainFacts,
    mdev_parent,
    parse_domain,
    resolve_claim,
)
from charly_arbiter.logsetup import log_setup

log = logging.getLogger(__name__)

__all__ = ["HookRun", "dispatch"]


def dispatch(guest: str, operation: str, extra: str, xml: bytes | None) -> int:
    """One handled operation for a domain whose XML may claim (`xml` is None when it
    was too large to read whole; the ledger then decides alone)."""
    log_setup(0, stderr=False)
    facts = None if xml is None else parse_domain(xml, guest)
    if facts is not None and not facts.mentions_gpus:
        return 0
    try:
        ref = Claimant.parse(f"libvirt:{guest}")
    except InvalidClaimant:
        # A name no claimant can have (libvirt allows a tab, the arbiter does not): a
        # domain that claims no GPU after all goes on; one that does fails closed, its
        # start refused (exit 2).  A stop exits 0 at the boundary whatever happens.
        if facts is not None and operation == "prepare" and _claim_of(facts) is None:
            return 0
        raise
    hook = HookRun(ref, guest)
    with marked(hook.config.state_dir, HOOK_DIR, str(ref)):
        try:
            if operation == "release":
                return hook.release(extra)  # by the ledger alone: its tokens may be gone
            if facts is None:
                return hook.reconnect(None) if operation == "reconnect" else 1
            claim = hook.claim(facts)
            if operation == "prepare":
                return hook.prepare(claim) if claim else 0
            if operation == "reconnect":
                return hook.reconnect(claim)
            return hook.migrate(claim)
        finally:
            hook.close()


def _claim_of(facts: DomainFacts) -> DomainClaim | None:
    """The claim a domain's XML makes, asked without its name (no holder is asked)."""
    tokens = token_catalogue(load_config())
    return resolve_claim(
        facts, tokens.token_for_address, lambda uuid: mdev_parent(HOST_ROOTS.sys, uuid)
    )


class HookRun(HookSession):
    def __init__(self, ref: Claimant, guest: str) -> None:
        super().__init__(str(ref))
        self.guest = guest

    def claim(self, facts: DomainFacts) -> DomainClaim | None:
        sys_root = self.roots.sys
        return resolve_claim(
            facts,
            self.tokens().token_for_address,
            lambda uuid: mdev_parent(sys_root, uuid),
        )

    def own_policy(self) -> Policy:
        return preemption_policy(self.config)

    def prepare(self, claim: DomainClaim) -> int:
        self.acquire(claim.mode, claim.tokens, transient=claim.transient)
        return 0

    def release(self, reason: str) -> int:
        """libvirt says the domain stopped (`reason` its why: `-` none, `failed`, ...)."""
        reason = "" if reason == "-" else reason
        return self.stopped(
            success=reason != "failed", reason=reason, told=reason or "no reason given"
        )

    def reconnect(self, claim: DomainClaim | None) -> int:
        """libvirtd restarted and found this domain running: its lease stays as it is."""
        state = Ledger(self.config.state_dir).read()
        lease = state.lease_of(self.ref)
        if lease is not None:
            log.info(
                "%s runs on after a libvirtd restart; its %s lease stays", self.ref, lease.mode
            )
            return 0
        if claim is None:
            return 0
        acquire = cli_command("acquire", f"--{claim.mode}", operands=[self.ref, *claim.tokens])
        others = sorted(
            {other.claimant for token in claim.tokens for other in state.leases_on(token)}
        )
        if others:
            # Its GPU sits in another lease (left stranded while libvirtd was down):
            # that one must be restored first, acquiring now would only be refused.
            log.warning(
                "%s runs with %s but holds no lease; %s still lease it: run %s, then %s",
                self.ref,
                ", ".join(claim.tokens),
                ", ".join(others),
                cli_command("restore", "--stranded"),
                acquire,
            )
        else:
            log.warning(
                "%s runs with %s but holds no lease; run %s",
                self.ref,
                ", ".join(claim.tokens),
                acquire,
            )
        return 0

    def migrate(self, claim: DomainClaim | None) -> int:
        if claim is not None and claim.mode is Mode.EXCLUSIVE:
            raise Refused(
                f"{self.ref} cannot migrate: it holds {', '.join(claim.tokens)} exclusively "
                "(a passed-through GPU stays on its host)",
                hint=f"shut {self.guest} down and start it on the other host instead",
            )
        return 0


def preemption_policy(config: Config) -> Policy:
    """What a VM's start may not stop (with `libvirt_preemption = "refuse"`: other VMs)."""
    if config.libvirt_preemption == Preemption.REFUSE:
        return Policy(
            refuse_kinds=frozenset({HolderKind.LIBVIRT}),
            refuse_hint="stop {holder} first (virsh shutdown), or run {acquire} outside "
            "libvirt, then start the VM again",
        )
    return NO_POLICY
