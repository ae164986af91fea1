"""`attach` and `detach`: a systemd service that claims its GPUs by itself.

`attach` writes the unit's drop-in (host/units.py) and records the unit as a
holder in attached.d/ beside arbiter.toml, so that an exclusive claim can stop
it (or, `--no-preemptible`, is refused by it) and start it again; `detach`
removes both.  The drop-in runs this very program with the options this
command was given, so the unit's claim lands in the same ledger.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App, claim_mode, mode_options
from charly_arbiter.compose import real_kinds
from charly_arbiter.core.config import (
    ENV_CONFIG,
    ENV_HOST,
    ENV_STATE_DIR,
    HolderConfig,
    attached_text,
    sim_directory,
)
from charly_arbiter.core.model import KINDS, Claimant, HolderKind, Mode
from charly_arbiter.errors import Refused
from charly_arbiter.host import units

KIND = HolderKind.SYSTEMD
UNIT_DIR_HELP = (
    "Where systemd reads drop-ins (default /etc/systemd/system; DIR/units for a simulated host)."
)


@click.command()
@functools.partial(
    mode_options,
    exclusive_help="Claim exclusively (vfio-pci).",
    shared_help="Claim shared (the default).",
)
@click.option(
    "--preemptible/--no-preemptible",
    default=True,
    show_default=True,
    help="Whether an exclusive claim may stop the unit (and start it again afterwards).",
)
@click.option("--unit-dir", type=click.Path(path_type=Path, file_okay=False), help=UNIT_DIR_HELP)
@click.argument("unit")
@click.argument("tokens", nargs=-1, required=True, shell_complete=complete.tokens)
@click.pass_obj
def attach(
    app: App,
    exclusive: bool,
    shared: bool,
    preemptible: bool,
    unit_dir: Path | None,
    unit: str,
    tokens: tuple[str],
) -> None:
    """Make systemd:UNIT claim TOKENS when it starts and release them when it stops."""
    mode = str(claim_mode(exclusive, shared, default=Mode.SHARED))
    ref = _unit_ref(unit)
    config = app.config()
    listed = config.holder(ref)
    if listed is not None and listed.attached is None:
        raise Refused(
            f"{ref} is listed in {config.path} already",
            hint="remove its [[holders]] table there first, or leave it as it is",
        )
    names = [spec.name for spec in app.arbiter().tokens.resolve(list(tokens))]
    dropin = units.dropin_path(unit_dir or _unit_dir(app), ref.name)
    program = [*_program(), *_options(app)]
    units.write_file(
        dropin,
        units.dropin_text(
            ref,
            names,
            [*program, "acquire", f"--{mode}", "--", ref, *names],
            [*program, "release", "--force", "--", ref],
        ),
    )
    record = config.attached_dir / f"{ref.name}.toml"
    holder = HolderConfig(
        ref, tuple(names), preemptible=preemptible, mode=mode, dropin=dropin, attached=record
    )
    try:
        units.write_file(record, attached_text(holder))
    except OSError:
        units.remove_file(dropin)
        raise
    click.echo(f"attached {ref} to {', '.join(names)} ({mode}): {dropin}")
    _reload(app)


@click.command()
@click.option("--force", is_flag=True, help="Detach even though the unit holds a lease now.")
@click.argument("unit", shell_complete=complete.claimants)
@click.pass_obj
def detach(app: App, force: bool, unit: str) -> None:
    """Remove what `attach` wrote for systemd:UNIT (its drop-in and its holder record)."""
    ref = _unit_ref(unit)
    config = app.config()
    holder = config.holder(ref)
    if holder is None or holder.attached is None:
        click.echo(f"{ref} is not attached")
        return
    lease = app.ledger().read().lease_of(ref)
    if lease is not None and not force:
        raise Refused(
            f"{ref} holds a {lease.mode} lease on {', '.join(lease.tokens)}; without its "
            "drop-in nothing would release it",
            hint=f"stop {ref} first (its ExecStopPost releases the GPU), or add --force",
        )
    if holder.dropin is not None:
        units.remove_file(holder.dropin)
    units.remove_file(holder.attached)
    click.echo(f"detached {ref}")
    _reload(app)


def _unit_ref(unit: str) -> Claimant:
    # A unit's own name may have a colon (systemd allows it): only a known kind before
    # the first one makes it KIND:NAME.
    ref = Claimant.parse(unit if unit.partition(":")[0] in KINDS else f"{KIND}:{unit}")
    if ref.kind != KIND:
        raise click.UsageError(f"{unit}: only systemd units attach (systemd:NAME.service)")
    units.check_unit(ref.name)
    return ref


def _program() -> list[str]:
    """How the unit runs this program: the launcher it was started as, or this
    interpreter with the package (a checkout, a virtual environment)."""
    launcher = sys.argv[0]
    if os.path.isabs(launcher) and os.path.basename(launcher) == "charly-arbiter":
        return [launcher]
    return [sys.executable, "-m", "charly_arbiter"]


def _options(app: App) -> list[str]:
    """The global options that made this command's configuration (systemd's
    environment has none of ours)."""
    found = []
    for option, given, variable in (
        ("--config", app.config_path, ENV_CONFIG),
        ("--state-dir", app.state_dir, ENV_STATE_DIR),
        ("--host", app.host_spec, ENV_HOST),
    ):
        value = str(given or os.environ.get(variable) or "")
        if value.startswith("sim:"):
            value = "sim:" + os.path.abspath(value.removeprefix("sim:"))
        elif value and option != "--host":
            value = os.path.abspath(value)
        if value:
            found += [option, value]
    return found


def _simulated_units(app: App) -> bool:
    """Whether this host's units are simulated (a `sim:DIR` without real systemd holders):
    then this machine's systemd is none of the command's business."""
    kinds = real_kinds(app.host())
    return kinds is not None and HolderKind.SYSTEMD not in kinds


def _unit_dir(app: App) -> Path:
    """/etc/systemd/system, or DIR/units for a simulated host (self-contained)."""
    directory = sim_directory(app.config().host)
    if directory is not None and _simulated_units(app):
        return directory / "units"
    return units.UNIT_DIR


def _reload(app: App) -> None:
    if _simulated_units(app):
        return
    why = units.daemon_reload()
    if why is not None:
        click.echo(f"systemd was not reloaded ({why}): run `systemctl daemon-reload`", err=True)
