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

from charly_arbiter.core import files
from charly_arbiter.core.config import Config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant, HolderKind, LeaseState, Preemption
from charly_arbiter.core.planner import NO_POLICY, Policy
from charly_arbiter.errors import ArbiterError
from charly_arbiter.hooksession import WATCH_START, Handoff, HookSession, detached_arbiter, spawn
from charly_arbiter.host.markers import HOOK_DIR, marked
from charly_arbiter.logsetup import log_setup
from charly_arbiter.proxmox.claims import VmClaim, vm_claim
from charly_arbiter.proxmox.holders import ct_config_path, proxmox_node, vm_config_path
from charly_arbiter.proxmox.vmconf import parse_vm_config, read_config_file

log = logging.getLogger(__name__)

__all__ = ["HookRun", "dispatch", "watch_start"]

# How long the start watcher waits for the VM's start to end (qemu-server's start
# timeout is minutes at most).
START_WAIT = 3600.0
# STATE/proxmox-started/VMID, which hook.py writes at post-start (its STARTED_DIR).
STARTED_DIR = "proxmox-started"


def dispatch(vmid: str, phase: str) -> int:
    """`pre-start` or `post-stop` of VM `vmid` (a validated VMID)."""
    log_setup(0, stderr=False)
    ref = Claimant.of(HolderKind.PROXMOX, vmid)
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
        tokens = list(self.tokens().all().values())
        return vm_claim(self.vmid, config, tokens, proxmox_node(self.config))

    def own_policy(self) -> Policy:
        return preemption_policy(self.config)

    def prepare(self, claim: VmClaim) -> int:
        forget_started(self.config, self.vmid)  # post-start of this start notes it again
        self.acquire(claim.mode, claim.tokens, transient=claim.transient)
        lease = Ledger(self.config.state_dir).read().lease_of(self.ref)
        if lease is not None:
            spawn_start_watch(self.config, self.ref, lease.created)
        return 0

    def release(self) -> int:
        """post-stop: the VM's QEMU is gone (a stop, a shutdown from inside, a crash)."""
        forget_started(self.config, self.vmid)
        return self.stopped()


# -- a start that fails after pre-start -------------------------------------------------


def spawn_start_watch(config: Config, ref: str, created: str) -> None:
    """Watch this VM's start to its end, in a process of its own (`_watch-start`,
    see watch_start).

    qemu-server runs no post-stop when the start fails after pre-start (QEMU does
    not start: vm_start_nolock cleans up its PCI reservations and dies), so the
    lease this pre-start took would be left with the GPU on vfio-pci and its
    holders stopped until someone ran `restore`."""
    spawn(WATCH_START, Handoff.of(config, ref, created=created))


def forget_started(config: Config, vmid: str) -> None:
    """Remove hook.py's post-start note of the VM (a validated VMID names it)."""
    (config.state_dir / STARTED_DIR / vmid).unlink(missing_ok=True)


def started(config: Config, vmid: str) -> bool:
    return (config.state_dir / STARTED_DIR / vmid).exists()


def watch_start(handoff: Handoff) -> int:
    """Wait for the VM's configuration lock (qemu-server holds it for the whole
    start, pre-start to post-start); holding it, no other start or cleanup of the
    VM can run.  If the start never reached post-start, the VM does not run and
    the lease this start took is still there, active, the start failed after
    pre-start: the release begins under the lock (a start of the VM right after
    waits for it) and finishes after it, so a `qm cleanup` is never kept waiting.
    A start that reached post-start is left alone, even if the VM has stopped
    since: its post-stop will release."""
    config, arbiter = detached_arbiter(handoff)
    ref, created = handoff.claimant, handoff.created
    claimant = Claimant.parse(ref)
    lock = config.proxmox.lock_dir / f"lock-{claimant.name}.conf"
    try:
        handle = lock.open("a")
    except OSError as error:
        log.warning("%s: cannot watch its start (%s: %s)", ref, lock, error.strerror)
        arbiter.host.close()
        return 0
    reason = "the start failed after pre-start"
    try:
        with handle:
            if not files.lock_within(handle, START_WAIT):
                log.warning("%s: its start did not end within %g s; not watched", ref, START_WAIT)
                return 0
            if started(config, claimant.name):
                return 0
            lease = arbiter.ledger.read().lease_of(claimant)
            if lease is None or lease.created != created or lease.state is not LeaseState.ACTIVE:
                return 0  # released already, or another start's lease
            if arbiter.host.is_running(claimant):
                return 0
            log.warning(
                "%s did not start after its pre-start claimed %s (Proxmox runs no post-stop "
                "then); releasing",
                ref,
                ", ".join(lease.tokens),
            )
            begun = arbiter.releaser().begin(claimant, False, reason)
            if begun is None or begun.lease is None:
                return 0
        arbiter.releaser().finish(claimant, False, reason, takeover=arbiter.owner)
    finally:
        arbiter.host.close()
    return 0


def preemption_policy(config: Config) -> Policy:
    """What a VM's start may not stop (with `[proxmox] preemption = "refuse"`: other VMs)."""
    if config.proxmox.preemption == Preemption.REFUSE:
        return Policy(
            refuse_kinds=frozenset({HolderKind.PROXMOX}),
            refuse_hint="stop {holder} first (qm shutdown), or run {acquire} outside "
            "Proxmox, then start the VM again",
        )
    return NO_POLICY
