"""`sim`: create and drive a simulated host, for demos, newcomers and tests."""

from __future__ import annotations

import json
from pathlib import Path

import click

from charly_arbiter.cli.app import App
from charly_arbiter.errors import HostError
from charly_arbiter.host.sim import EXAMPLE, SimHost

CONFIG_EXAMPLE = """\
# charly-arbiter configuration for the simulated host in this directory.
host = "sim:{directory}"
state_dir = "{directory}/state"

[timeouts]
# A simulated VM starts at once: a claimant that does not run 1 s after its
# claim is stranded (the default, 60 s, leaves a real VM time to boot).
claim_grace = 1

[tokens.gpu0]
address = "0000:0a:00.0"

[tokens.gpu1]
address = "0000:0b:00.0"
"""


@click.group()
def sim() -> None:
    """Create and drive a simulated host (sim:DIR)."""


@sim.command()
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
def init(directory: Path) -> None:
    """Write an example simulated host and a configuration for it into DIRECTORY."""
    directory = directory.absolute()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    host_file = directory / "host.toml"
    if host_file.exists():
        raise click.ClickException(f"{host_file} exists; remove it first")
    host_file.write_text(EXAMPLE)
    (directory / "arbiter.toml").write_text(CONFIG_EXAMPLE.format(directory=directory))
    click.echo(f"wrote {host_file} and {directory / 'arbiter.toml'}")


def _sim(app: App) -> SimHost:
    host = app.host()
    if not isinstance(host, SimHost):
        raise HostError("this command needs a simulated host: pass --host sim:DIR")
    return host


@sim.command()
@click.pass_obj
def show(app: App) -> None:
    """Print the simulated host's current state as JSON."""
    click.echo(json.dumps(_sim(app).snapshot(), indent=2, sort_keys=True))


@sim.command("stop")
@click.argument("ref")
@click.pass_obj
def stop_holder(app: App, ref: str) -> None:
    """Mark a holder or claimant (KIND:NAME) as not running, as if it crashed."""
    _sim(app).set_running(ref, False)


@sim.command("start")
@click.argument("ref")
@click.pass_obj
def start_holder(app: App, ref: str) -> None:
    """Mark a holder or claimant (KIND:NAME) as running."""
    _sim(app).set_running(ref, True)


@sim.command()
@click.pass_obj
def reboot(app: App) -> None:
    """Simulate a reboot: new boot id, drivers and holders as described, claimants gone."""
    _sim(app).reboot()
