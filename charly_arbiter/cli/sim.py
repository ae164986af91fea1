"""`sim`: create and drive a simulated host, for demos, newcomers and tests."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App, needs_subcommand
from charly_arbiter.core.model import Claimant
from charly_arbiter.errors import NeedsHost, Refused, cli_command
from charly_arbiter.host.draining import machine
from charly_arbiter.host.sim import EXAMPLE, SimHost

CONFIG_EXAMPLE = """\
# charly-arbiter configuration for the simulated host in this directory: what
# `--host sim:DIR` reads when no --config is given (never /etc/charly-arbiter).
host = {host}
state_dir = {state_dir}

[timeouts]
# A simulated VM starts at once: a claimant that does not run 1 s after its
# claim is stranded (the default, 60 s, leaves a real VM time to boot).
claim_grace = 1

[tokens.gpu0]
address = "0000:0a:00.0"

[tokens.gpu1]
address = "0000:0b:00.0"
"""


@click.group(invoke_without_command=True, no_args_is_help=False)
@click.pass_context
def sim(ctx: click.Context) -> None:
    """Create and drive a simulated host (sim:DIR)."""
    needs_subcommand(ctx)


@sim.command()
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
def init(directory: Path) -> None:
    """Write an example simulated host and a configuration for it into DIRECTORY."""
    directory = directory.absolute()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    host_file = directory / "host.toml"
    if host_file.exists():
        raise Refused(
            f"{host_file} exists; nothing was written",
            hint="remove it first, or use that host: "
            + cli_command("--host", f"sim:{directory}", "status"),
        )
    host_file.write_text(EXAMPLE)
    config = directory / "arbiter.toml"
    state = directory / "state"
    # JSON strings are TOML basic strings: a directory with a quote stays one string.
    config.write_text(
        CONFIG_EXAMPLE.format(host=json.dumps(f"sim:{directory}"), state_dir=json.dumps(str(state)))
    )
    click.echo(f"wrote {host_file} and {config}")
    click.echo(
        f"This simulated host keeps its configuration ({config}) and its state ({state}) "
        "in that directory; nothing of this machine's /etc/charly-arbiter or "
        "/var/lib/charly-arbiter is read or written."
    )
    click.echo(
        f"Use it with {cli_command('--host', f'sim:{directory}', 'status')}, or "
        + cli_command_env(directory)
    )


def cli_command_env(directory: Path) -> str:
    """The export that selects this simulated host for every command of a shell."""
    return f"`export CHARLY_ARBITER_HOST={shlex.quote(f'sim:{directory}')}` and then any command."


def _sim(app: App) -> SimHost:
    host = machine(app.host())
    if not isinstance(host, SimHost):
        raise NeedsHost(
            "this command",
            f"a simulated host, and {host.description} is not one",
            "pass --host sim:DIR (a directory that `sim init DIR` made)",
        )
    return host


@sim.command()
@click.pass_obj
def show(app: App) -> None:
    """Print the simulated host's current state as JSON."""
    click.echo(json.dumps(_sim(app).snapshot(), indent=2, sort_keys=True))


@sim.command("stop")
@click.argument("ref", shell_complete=complete.claimants)
@click.pass_obj
def stop_holder(app: App, ref: str) -> None:
    """Mark a holder or claimant (KIND:NAME) as not running, as if it crashed."""
    _sim(app).set_running(Claimant.parse(ref), False)


@sim.command("start")
@click.argument("ref", shell_complete=complete.claimants)
@click.pass_obj
def start_holder(app: App, ref: str) -> None:
    """Mark a holder or claimant (KIND:NAME) as running."""
    _sim(app).set_running(Claimant.parse(ref), True)


@sim.command()
@click.pass_obj
def reboot(app: App) -> None:
    """Simulate a reboot: new boot id, drivers and holders as described, claimants gone."""
    _sim(app).reboot()
