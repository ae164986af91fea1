"""The one place that wires an Arbiter: configuration, host, ledger and events.

The CLI, the hooks (hooksession.py) and the processes they start all build
their arbiter here, so they see the same host with the same holder sources.  It
is also where the layers meet: the host gets its holder sources from here
(libvirt's domains live above it, in `libvirt/`), and `subject`, the domain or
container a hook runs for (`libvirt:NAME`, `container:NAME`), reaches the
source of its kind as an argument, never through the environment.  Each
source is imported only when a ref of its kind comes up: libvirt's domains,
and Proxmox's VMs and containers (`proxmox/`), live above `host/`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config
from charly_arbiter.core.host import Holder, Host, TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant, HolderKind, ProcessRef
from charly_arbiter.core.tokens import TokenCatalogue
from charly_arbiter.errors import HolderError
from charly_arbiter.host.holders import HolderSource, SourceFactory

if TYPE_CHECKING:
    from charly_arbiter.proxmox.holders import DeviceNodes


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

        return ContainerHolders(config, subject=subject_of(HolderKind.CONTAINER))

    def domains(config: Config) -> HolderSource:
        from charly_arbiter.libvirt.domains import LibvirtHolders

        return LibvirtHolders(config, subject=subject_of(HolderKind.LIBVIRT))

    def proxmox_vms(config: Config) -> HolderSource:
        if not (config.proxmox.config_dir / "qemu-server").is_dir():
            return NoGuests(HolderKind.PROXMOX)
        from charly_arbiter.proxmox.holders import ProxmoxHolders

        return ProxmoxHolders(config, subject=subject_of(HolderKind.PROXMOX))

    def proxmox_containers(config: Config) -> HolderSource:
        if not (config.proxmox.config_dir / "lxc").is_dir():
            return NoGuests(HolderKind.LXC)
        from charly_arbiter.proxmox.holders import LxcHolders

        return LxcHolders(config, device_nodes(config))

    return {
        HolderKind.PROCESS: processes,
        HolderKind.SYSTEMD: systemd,
        HolderKind.CONTAINER: containers,
        HolderKind.LIBVIRT: domains,
        HolderKind.PROXMOX: proxmox_vms,
        HolderKind.LXC: proxmox_containers,
    }


class NoGuests:
    """Proxmox guests on a host that is no Proxmox VE node (its configuration
    directory is missing): none to find, none running, and the Proxmox modules are
    never imported for a claim there."""

    def __init__(self, kind: HolderKind) -> None:
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
    from charly_arbiter.host.sysfs import HOST_ROOTS

    roots = HOST_ROOTS
    return DeviceNodes(roots.dev, lambda numbers: device_functions(roots.sys, roots.proc, numbers))


def open_host(config: Config, *, subject: str | None = None) -> Host:
    """The host the configuration names: `local`, or `sim:DIR` (with real holders of
    the kinds its host.toml lists), with the configured drains around it."""
    from charly_arbiter.host.draining import Drained

    sources = holder_sources(subject)
    if config.host.startswith("sim:"):
        from charly_arbiter.host.hybrid import open_sim

        return Drained(open_sim(config, sources), config)
    from charly_arbiter.host.local import LocalHost

    return Drained(LocalHost(config, sources=sources), config)


def real_kinds(host: Host) -> frozenset[str] | None:
    """The holder kinds `host` asks this machine about: None for the local host (every
    kind), the `real_holders` of a simulated one (none for a plain `sim:DIR`)."""
    from charly_arbiter.host.draining import machine
    from charly_arbiter.host.hybrid import HybridHost
    from charly_arbiter.host.sim import SimHost

    host = machine(host)
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
    tokens: TokenCatalogue | None = None,
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
        tokens=tokens,
    )


def token_catalogue(config: Config) -> TokenCatalogue:
    """The tokens of the configured host, read from its PCI side alone (sysfs, or a
    simulated host's files): a hook maps a domain's or a VM's addresses to tokens
    with it, and builds the whole host (holder sources, NVML) only for a claim."""
    if config.host.startswith("sim:"):
        from charly_arbiter.host.sim import SimHost

        directory = Path(config.host.removeprefix("sim:"))
        return TokenCatalogue(config, SimHost(directory, config.timeouts.driver_switch))
    from charly_arbiter.host.local import LocalPci

    return TokenCatalogue(config, LocalPci())
