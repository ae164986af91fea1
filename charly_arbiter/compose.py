"""Opening the host named by the configuration: `local` or `sim:DIR`."""

from __future__ import annotations

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import Host


def open_host(config: Config) -> Host:
    if config.host.startswith("sim:"):
        # A simulated host, with real holders of the kinds its host.toml lists.
        from charly_arbiter.host.hybrid import open_sim

        return open_sim(config)
    from charly_arbiter.host.local import LocalHost

    return LocalHost(config)
