"""Opening the host named by the configuration: `local` or `sim:DIR`."""

from __future__ import annotations

from pathlib import Path

from charly_arbiter.config import Config
from charly_arbiter.host import Host


def open_host(config: Config) -> Host:
    if config.host.startswith("sim:"):
        from charly_arbiter.simhost import SimHost

        return SimHost(Path(config.host.removeprefix("sim:")), config.timeouts.driver_switch)
    from charly_arbiter.localhost import LocalHost

    return LocalHost(config)
