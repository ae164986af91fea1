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
import sys
from pathlib import Path

from charly_arbiter.compose import HookSession, build_arbiter, log_to_file, spawn_finish_release
from charly_arbiter.core import files
from charly_arbiter.core.config import Config, load_config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant, LeaseState
from charly_arbiter.core.planner import NO_POLICY, Policy
from charly_arbiter.errors import ArbiterError
from charly_arbiter.host.markers import HOOK_DIR, marked
from charly_arbiter.host.run import spawn_detached
from charly_arbiter.logsetup import log_setup
from charly_arbiter.proxmox.claims import VmClaim, vm_claim
from charly_arbiter.proxmox.holders import ct_config_path, proxmox_node, vm_config_path
from charly_arbiter.proxmox.vmconf import parse_vm_config, read_config_file

log = logging.getLogger(__name__)

__all__ = ["WATCHER", "HookRun", "dispatch", "watch_start"]

# The start watcher's first argument (and its name in ps), and how long it waits for
# the VM's start to end (qemu-server's start timeout is minutes at most).
WATCHER = "watch-start"
START_WAIT = 3600.0
# STATE/proxmox-started/VMID, which hook.py writes at post-start (its STARTED_DIR).
STARTED_DIR = "proxmox-started"


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
        forget_started(self.config, self.vmid)  # post-start of this start notes it again
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
        lease = Ledger(self.config.state_dir).read().lease_of(self.ref)
        if lease is not None:
            spawn_start_watch(self.config, self.ref, lease.created)
        return 0

    def release(self) -> int:
        """post-stop: the VM's QEMU is gone (a stop, a shutdown from inside, a crash)."""
        forget_started(self.config, self.vmid)
        lease = Ledger(self.config.state_dir).read().lease_of(self.ref)
        nested = self.nested()
        log.info("%s stopped%s", self.ref, " by the arbiter" if nested else "")
        if lease is None:
            return 0  # a refused start, or a holder whose lease moved: nothing is ours
        arbiter = self.arbiter()
        if lease.unrestored() and not nested:
            # Starting what the claim stopped runs `qm start`/`pct start`, which may
            # take a while: a detached process does it, and `qm cleanup` returns.
            begun = arbiter.releaser().begin(self.ref, True, "")
            if begun is not None and begun.lease is not None:
                spawn_finish_release(self.config, self.ref, "", arbiter.owner)
            return 0
        # Proxmox says the VM has stopped: no need to ask whether it runs.
        arbiter.release_claimant(self.ref, success=True, reason="", force=True, stopped=True)
        return 0


# -- a start that fails after pre-start -------------------------------------------------


def spawn_start_watch(config: Config, ref: str, created: str) -> None:
    """Watch this VM's start to its end, in a process of its own (see watch_start).

    qemu-server runs no post-stop when the start fails after pre-start (QEMU does
    not start: vm_start_nolock cleans up its PCI reservations and dies), so the
    lease this pre-start took would be left with the GPU on vfio-pci and its
    holders stopped until someone ran `restore`."""
    package_parent = str(Path(__file__).resolve().parent.parent.parent)
    spawn_detached(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); "
            "from charly_arbiter.proxmox.hookrun import watch_start; "
            "sys.exit(watch_start(sys.argv[3:]))",
            package_parent,
            WATCHER,
            str(config.path or "-"),
            str(config.state_dir),
            config.host,
            ref,
            created,
        ]
    )


def forget_started(config: Config, vmid: str) -> None:
    """Remove hook.py's post-start note of the VM (a validated VMID names it)."""
    (config.state_dir / STARTED_DIR / vmid).unlink(missing_ok=True)


def started(config: Config, vmid: str) -> bool:
    return (config.state_dir / STARTED_DIR / vmid).exists()


def watch_start(argv: list[str]) -> int:
    """Wait for the VM's configuration lock (qemu-server holds it for the whole
    start, pre-start to post-start); holding it, no other start or cleanup of the
    VM can run.  If the start never reached post-start, the VM does not run and
    the lease this start took is still there, active, the start failed after
    pre-start: the release begins under the lock (a start of the VM right after
    waits for it) and finishes after it, so a `qm cleanup` is never kept waiting.
    A start that reached post-start is left alone, even if the VM has stopped
    since: its post-stop will release."""
    if len(argv) != 5:
        print(
            f"charly-arbiter: usage: {WATCHER} CONFIG STATE_DIR HOST CLAIMANT CREATED",
            file=sys.stderr,
        )
        return 2
    config_path, state_dir, host, ref, created = argv
    log_setup(1, stderr=False)  # (its stderr is /dev/null: it runs detached)
    config = load_config(
        None if config_path == "-" else Path(config_path), state_dir=Path(state_dir), host=host
    )
    log_to_file(config)
    claimant = Claimant.parse(ref)
    lock = config.proxmox.lock_dir / f"lock-{claimant.name}.conf"
    try:
        handle = lock.open("a")
    except OSError as error:
        log.warning("%s: cannot watch its start (%s: %s)", ref, lock, error.strerror)
        return 0
    arbiter = build_arbiter(config)
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
    if config.proxmox.preemption == "refuse":
        return Policy(
            refuse_kinds=frozenset({"proxmox"}),
            refuse_hint="stop {holder} first (qm shutdown), or run {acquire} outside "
            "Proxmox, then start the VM again",
        )
    return NO_POLICY
