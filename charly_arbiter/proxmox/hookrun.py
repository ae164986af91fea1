"""The hookscript's slow path: a VM that may claim a GPU, or may hold a lease.

`hook.py` decided from a byte scan that the VM's configuration (or the ledger)
concerns the arbiter; everything after that is here.  qemu-server holds the
VM's configuration lock while its hookscript runs (vm_start, and `qm cleanup`
for post-stop), so while this runs a marker says so: other arbiter processes
then never ask `qm` about this VM.  A release whose lease stopped holders hands
the way home to a detached process, after the lease has turned `releasing`
under the lock, so that `qm cleanup` (and the next start) is not kept waiting.
"""

from __future__ import annotations

import logging

from charly_arbiter.compose import HookSession, spawn_finish_release
from charly_arbiter.core.config import Config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant
from charly_arbiter.core.planner import NO_POLICY, Policy
from charly_arbiter.errors import ArbiterError
from charly_arbiter.host.markers import HOOK_DIR, marked
from charly_arbiter.logsetup import log_setup
from charly_arbiter.proxmox.claims import VmClaim, vm_claim
from charly_arbiter.proxmox.holders import ct_config_path, proxmox_node, vm_config_path
from charly_arbiter.proxmox.vmconf import parse_vm_config, read_config_file

log = logging.getLogger(__name__)

__all__ = ["HookRun", "dispatch"]


def dispatch(vmid: str, phase: str) -> int:
    """`pre-start` or `post-stop` of VM `vmid` (a validated VMID)."""
    log_setup(0, stderr=False)
    ref = Claimant.of("proxmox", vmid)
    hook = HookRun(ref, vmid)
    with marked(hook.config.state_dir, HOOK_DIR, str(ref)):
        try:
            if phase == "post-stop":
                return hook.release()
            claim = hook.claim()
            return hook.prepare(claim) if claim is not None else 0
        finally:
            hook.close()


class HookRun(HookSession):
    def __init__(self, ref: Claimant, vmid: str) -> None:
        super().__init__(str(ref))
        self.vmid = vmid

    def claim(self) -> VmClaim | None:
        """The VM's claim from its configuration (None: it claims nothing)."""
        path = vm_config_path(self.config, self.vmid)
        data = read_config_file(path, self.ref)
        if data is None:
            if ct_config_path(self.config, self.vmid).exists():
                log.info("%s is a container: containers are holders, not claimants", self.vmid)
                return None
            raise ArbiterError(
                f"{self.ref} has no configuration on this node ({path} does not exist)",
                hint="the hookscript is meant for VMs of this node (docs/proxmox.md)",
            )
        config = parse_vm_config(data, self.ref, path)
        tokens = list(self.arbiter().tokens.all().values())
        return vm_claim(self.vmid, config, tokens, proxmox_node(self.config))

    def own_policy(self) -> Policy:
        return preemption_policy(self.config)

    def prepare(self, claim: VmClaim) -> int:
        plan = self.arbiter().acquire(
            self.ref,
            claim.mode,
            list(claim.tokens),
            transient=claim.transient,
            policy=self.policy(),
        )
        stopped = ", ".join(step.holder for step in plan.stops)
        log.info(
            "%s holds %s (%s)%s",
            self.ref,
            ", ".join(plan.tokens),
            plan.mode,
            f"; stopped {stopped}" if stopped else "",
        )
        return 0

    def release(self) -> int:
        """post-stop: the VM's QEMU is gone (a stop, a shutdown from inside, a crash)."""
        lease = Ledger(self.config.state_dir).read().lease_of(self.ref)
        nested = self.nested()
        log.info("%s stopped%s", self.ref, " by the arbiter" if nested else "")
        if lease is None:
            return 0  # a refused start, or a holder whose lease moved: nothing is ours
        arbiter = self.arbiter()
        if lease.unrestored() and not nested:
            # Starting what the claim stopped runs `qm start`/`pct start`, which may
            # take a while: a detached process does it, and `qm cleanup` returns.
            if arbiter.releaser().begin(self.ref, True, ""):
                spawn_finish_release(self.config, self.ref, "", arbiter.owner)
            return 0
        # Proxmox says the VM has stopped: no need to ask whether it runs.
        arbiter.release_claimant(self.ref, success=True, reason="", force=True)
        return 0


def preemption_policy(config: Config) -> Policy:
    """What a VM's start may not stop (with `[proxmox] preemption = "refuse"`: other VMs)."""
    if config.proxmox.preemption == "refuse":
        return Policy(
            refuse_kinds=frozenset({"proxmox"}),
            refuse_hint="stop {holder} first (qm shutdown), or run `charly-arbiter "
            "acquire --exclusive {claimant} {token}` outside Proxmox, then start the "
            "VM again",
        )
    return NO_POLICY
