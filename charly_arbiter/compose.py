"""The one place that wires an Arbiter: configuration, host, ledger and events.

The CLI, the libvirt hook and the hook's detached release all build their
arbiter here, so the three see the same host with the same holder sources.  It
is also where the layers meet: the host gets its holder sources from here
(libvirt's domains live above it, in `libvirt/`), and `subject`, the domain or
container a hook runs for (`libvirt:NAME`, `container:NAME`), reaches the
source of its kind as an argument, never through the environment.  Each
source is imported only when a ref of its kind comes up: libvirt's domains,
and Proxmox's VMs and containers (`proxmox/`), live above `host/`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config, load_config
from charly_arbiter.core.host import Holder, Host, TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant, ProcessRef
from charly_arbiter.core.planner import NO_POLICY, Policy
from charly_arbiter.errors import HolderError
from charly_arbiter.host.holders import HolderSource, SourceFactory
from charly_arbiter.host.markers import is_acting
from charly_arbiter.host.run import spawn_detached
from charly_arbiter.logsetup import log_setup

if TYPE_CHECKING:
    from charly_arbiter.proxmox.holders import DeviceNodes

# The detached release's first argument (and its name in ps): a hook hands the rest
# of a release that brings holders back to a process of its own (see below).
DETACHED = "finish-release"
# Every kind a holder or claimant ref may have (`KIND:NAME`) that a source answers for.
HOLDER_KINDS = ("process", "systemd", "container", "libvirt", "proxmox", "lxc")


def holder_sources(subject: str | None = None) -> dict[str, SourceFactory]:
    """kind -> a factory of its holder source; `subject` is the claimant a hook is about."""
    about = Claimant.parse(subject) if subject else None

    def subject_of(kind: str) -> str | None:
        return about.name if about is not None and about.kind == kind else None

    def processes(config: Config) -> HolderSource:
        from charly_arbiter.host.holders.process import ProcessHolders

        return ProcessHolders(config)

    def systemd(config: Config) -> HolderSource:
        from charly_arbiter.host.holders.systemd import SystemdHolders

        return SystemdHolders(config)

    def containers(config: Config) -> HolderSource:
        from charly_arbiter.host.holders.container import ContainerHolders

        return ContainerHolders(config, subject=subject_of("container"))

    def domains(config: Config) -> HolderSource:
        from charly_arbiter.libvirt.domains import LibvirtHolders

        return LibvirtHolders(config, subject=subject_of("libvirt"))

    def proxmox_vms(config: Config) -> HolderSource:
        if not (config.proxmox.config_dir / "qemu-server").is_dir():
            return NoGuests("proxmox")
        from charly_arbiter.proxmox.holders import ProxmoxHolders

        return ProxmoxHolders(config, subject=subject_of("proxmox"))

    def proxmox_containers(config: Config) -> HolderSource:
        if not (config.proxmox.config_dir / "lxc").is_dir():
            return NoGuests("lxc")
        from charly_arbiter.proxmox.holders import LxcHolders

        return LxcHolders(config, device_nodes(config))

    return {
        "process": processes,
        "systemd": systemd,
        "container": containers,
        "libvirt": domains,
        "proxmox": proxmox_vms,
        "lxc": proxmox_containers,
    }


class NoGuests:
    """Proxmox guests on a host that is no Proxmox VE node (its configuration
    directory is missing): none to find, none running, and the Proxmox modules are
    never imported for a claim there."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        return []

    def is_running(self, ref: Claimant) -> bool:
        return False

    def stop(self, ref: Claimant) -> None:
        raise HolderError(ref, "stop", "this host is no Proxmox VE node")

    def start(self, ref: Claimant) -> None:
        raise HolderError(ref, "start", "this host is no Proxmox VE node")


def device_nodes(config: Config) -> DeviceNodes:
    """This host's /dev and which GPU function a character device is a node of: the
    machine's own, or a simulated host's (its nodes are files under DIR/dev)."""
    from charly_arbiter.proxmox.holders import DeviceNodes

    if config.host.startswith("sim:"):
        from charly_arbiter.host.sim import SimHost

        sim = SimHost(Path(config.host.removeprefix("sim:")), config.timeouts.driver_switch)
        return DeviceNodes(sim.dev_root, sim.device_functions)
    from charly_arbiter.host.devnodes import device_functions
    from charly_arbiter.host.sysfs import Roots

    roots = Roots()
    return DeviceNodes(roots.dev, lambda numbers: device_functions(roots.sys, roots.proc, numbers))


def open_host(config: Config, *, subject: str | None = None) -> Host:
    """The host the configuration names: `local`, or `sim:DIR` (with real holders of
    the kinds its host.toml lists)."""
    sources = holder_sources(subject)
    if config.host.startswith("sim:"):
        from charly_arbiter.host.hybrid import open_sim

        return open_sim(config, sources)
    from charly_arbiter.host.local import LocalHost

    return LocalHost(config, sources=sources)


def real_kinds(host: Host) -> frozenset[str] | None:
    """The holder kinds `host` asks this machine about: None for the local host (every
    kind), the `real_holders` of a simulated one (none for a plain `sim:DIR`)."""
    from charly_arbiter.host.hybrid import HybridHost
    from charly_arbiter.host.sim import SimHost

    if isinstance(host, HybridHost):
        return frozenset(host.real.kinds)
    if isinstance(host, SimHost):
        return frozenset()
    return None


def open_ledger(config: Config) -> Ledger:
    return Ledger(config.state_dir, config.timeouts.lock_wait)


def build_arbiter(
    config: Config,
    *,
    host: Host | None = None,
    ledger: Ledger | None = None,
    subject: str | None = None,
    progress: bool = False,
    owner: ProcessRef | None = None,
) -> Arbiter:
    """An Arbiter over `host` (opened from the configuration when not given), the
    configured ledger, and the event sinks for this kind of process (`progress`
    lines only for an interactive command, never for a hook)."""
    from charly_arbiter.ops.eventlog import events_for
    from charly_arbiter.ops.history import HistoryLog

    return Arbiter(
        config,
        host or open_host(config, subject=subject),
        ledger or open_ledger(config),
        events_for(config, progress=progress),
        owner,
        # The ledger is held to the generation the history recorded last: one that
        # went backwards (deleted, replaced) is refused until an operator decides.
        generation_floor=HistoryLog(config.state_dir).highest_generation,
    )


# -- the detached half of a hook's release -------------------------------------------------


def spawn_finish_release(config: Config, ref: str, reason: str, owner: ProcessRef) -> None:
    """Hand the rest of `release` to a process of its own, with nothing of the hook's
    (libvirt's or a container runtime's: a stop is never kept waiting for holders).

    The child gets a fixed environment, so it is pointed at the directory this
    package was loaded from (an installed package, or a checkout on PYTHONPATH).
    It takes the releasing lease over from `owner` (this hook), which may have
    exited by the time it looks.
    """
    package_parent = str(Path(__file__).resolve().parent.parent)
    spawn_detached(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); "
            "from charly_arbiter.compose import finish_release; "
            "sys.exit(finish_release(sys.argv[3:]))",
            package_parent,
            DETACHED,
            str(config.path or "-"),
            str(config.state_dir),
            config.host,
            ref,
            reason or "-",
            f"{owner.pid}:{owner.start}",
        ]
    )


def finish_release(argv: list[str]) -> int:
    """The detached half of `release`: send home, restore holders, drop the lease."""
    if len(argv) != 6:
        print(
            f"charly-arbiter: usage: {DETACHED} CONFIG STATE_DIR HOST CLAIMANT REASON PID:START",
            file=sys.stderr,
        )
        return 2
    config_path, state_dir, host, ref, reason, began_by = argv
    reason = "" if reason == "-" else reason
    pid, _, start = began_by.partition(":")
    takeover = ProcessRef(int(pid), int(start or "0"))
    log_setup(1, stderr=False)  # (its stderr is /dev/null: it runs detached)
    config = load_config(
        None if config_path == "-" else Path(config_path), state_dir=Path(state_dir), host=host
    )
    log_to_file(config)
    arbiter = build_arbiter(config)
    try:
        arbiter.releaser().finish(ref, reason != "failed", reason, takeover=takeover)
    finally:
        arbiter.host.close()
    return 0


def log_to_file(config: Config) -> None:
    """The steps of every hook call go to `hook_log` when it is set (the system log
    keeps only the warnings)."""
    if config.hook_log is None:
        return
    handler = logging.FileHandler(config.hook_log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("charly_arbiter")
    for existing in root.handlers:
        existing.setLevel(logging.WARNING)
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))


class HookSession:
    """What a hook call that has to decide holds: the configuration (read once, its
    log set up) and, built only when a claim needs it, the arbiter, whose holder
    sources never ask about `subject` (libvirt or the runtime would wait on this
    very call).  Both hooks' runs are one of these."""

    def __init__(self, subject: str) -> None:
        self.ref = subject
        self.config = load_config()
        log_to_file(self.config)
        self._arbiter: Arbiter | None = None

    def arbiter(self) -> Arbiter:
        if self._arbiter is None:
            self._arbiter = build_arbiter(self.config, subject=self.ref)
        return self._arbiter

    def close(self) -> None:
        if self._arbiter is not None:
            self._arbiter.host.close()

    def nested(self) -> bool:
        """Whether this hook runs because the arbiter itself stops or starts its subject."""
        return is_acting(self.config.state_dir, self.ref)

    def policy(self) -> Policy:
        """A nested hook never stops a holder (its caller is stopping or starting
        one already); otherwise the hook's own rules, `own_policy`."""
        if self.nested():
            return Policy(
                refuse_kinds=frozenset(HOLDER_KINDS),
                refuse_hint="{claimant} was started by the arbiter itself, which never "
                "stops {holder} from a nested hook; stop {holder} first",
            )
        return self.own_policy()

    def own_policy(self) -> Policy:
        return NO_POLICY
