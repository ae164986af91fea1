"""The one place that wires an Arbiter: configuration, host, ledger and events.

The CLI, the libvirt hook and the hook's detached release all build their
arbiter here, so the three see the same host with the same holder sources.  It
is also where the layers meet: the host gets its holder sources from here
(libvirt's domains live above it, in `libvirt/`), and `subject`, the domain a
hook runs for, reaches the libvirt source as an argument, never through the
environment.  Each source is imported only when a ref of its kind comes up.
"""

from __future__ import annotations

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config
from charly_arbiter.core.host import Host
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import ProcessRef
from charly_arbiter.host.holders import HolderSource, SourceFactory

# Every kind a holder or claimant ref may have (`KIND:NAME`) that a source answers for.
HOLDER_KINDS = ("process", "systemd", "container", "libvirt")


def holder_sources(subject: str | None = None) -> dict[str, SourceFactory]:
    """kind -> a factory of its holder source; `subject` is the domain a hook is about."""

    def processes(config: Config) -> HolderSource:
        from charly_arbiter.host.holders.process import ProcessHolders

        return ProcessHolders(config)

    def systemd(config: Config) -> HolderSource:
        from charly_arbiter.host.holders.systemd import SystemdHolders

        return SystemdHolders(config)

    def containers(config: Config) -> HolderSource:
        from charly_arbiter.host.holders.container import ContainerHolders

        return ContainerHolders(config)

    def domains(config: Config) -> HolderSource:
        from charly_arbiter.libvirt.domains import LibvirtHolders

        return LibvirtHolders(config, subject=subject)

    return {"process": processes, "systemd": systemd, "container": containers, "libvirt": domains}


def open_host(config: Config, *, subject: str | None = None) -> Host:
    """The host the configuration names: `local`, or `sim:DIR` (with real holders of
    the kinds its host.toml lists)."""
    sources = holder_sources(subject)
    if config.host.startswith("sim:"):
        from charly_arbiter.host.hybrid import open_sim

        return open_sim(config, sources)
    from charly_arbiter.host.local import LocalHost

    return LocalHost(config, sources=sources)


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

    return Arbiter(
        config,
        host or open_host(config, subject=subject),
        ledger or open_ledger(config),
        events_for(config, progress=progress),
        owner,
    )
