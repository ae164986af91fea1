"""`recover`: the only way past a corrupt ledger, and only after looking."""

from __future__ import annotations

import click

from charly_arbiter.cli.app import App
from charly_arbiter.errors import cli_command
from charly_arbiter.ops.recovery import compare, recover


@click.command("recover")
@click.option("--yes", is_flag=True, help="Write: move the corrupt ledger aside and continue.")
@click.option(
    "--empty",
    is_flag=True,
    help="Continue from an empty ledger instead of the backup (tokens on vfio-pci get poisoned).",
)
@click.pass_obj
def recover_command(app: App, yes: bool, empty: bool) -> None:
    """Compare a corrupt ledger's backup with the host; with --yes, continue from it."""
    arbiter = app.arbiter()
    comparison = compare(arbiter)
    if comparison.corrupt is None:
        click.echo("the ledger verifies; there is nothing to recover")
        return
    click.echo(str(comparison.corrupt))
    if comparison.backup is None:
        click.echo(f"the backup cannot be used: {comparison.backup_problem}")
    for line in comparison.lines:
        click.echo(line)
    if not yes:
        empty = empty or comparison.backup is None
        source = "an empty ledger (tokens on vfio-pci poisoned)" if empty else "the backup"
        options = ["--empty", "--yes"] if empty else ["--yes"]
        click.echo(
            f"nothing was written; to continue from {source}, run "
            + cli_command("recover", *options)
        )
        return
    state, aside = recover(arbiter, comparison, empty=empty)
    if aside is not None:
        click.echo(f"moved the corrupt ledger to {aside}")
    click.echo(
        f"the ledger now holds {len(state.leases)} leases"
        + (f" and poisons {', '.join(t for t, _ in state.poisoned)}" if state.poisoned else "")
        + f"; run {cli_command('status')}, then {cli_command('restore', '--stranded')} "
        "if it shows any"
    )
