"""`recover`: the only way past a corrupt ledger, or one that went backwards, and only
after looking."""

from __future__ import annotations

import click

from charly_arbiter.cli.app import App
from charly_arbiter.core.events import count_of
from charly_arbiter.errors import cli_command
from charly_arbiter.ops.history import HistoryLog
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
    """Compare a corrupt ledger's backup with the host, or a ledger that went backwards
    with what the history says it held; with --yes, continue."""
    arbiter = app.arbiter()
    history = HistoryLog(app.config().state_dir).read().records
    comparison = compare(arbiter, history)
    if comparison.went_back:
        if empty:
            raise click.UsageError("--empty is for a corrupt ledger; this one verifies")
        for line in comparison.lines:
            click.echo(line)
        settle = "".join(
            f"; then settle {name} with {cli_command('adopt', operands=[name, 'KIND:NAME'])} "
            f"or {cli_command('send-home', operands=[name])} "
            f"(see {cli_command('explain', operands=[name])})"
            for name in comparison.unaccounted
        )
        if not yes:
            click.echo(
                f"nothing was written; to continue from the ledger as it is, run "
                f"{cli_command('recover', '--yes')}{settle}"
            )
            return
        state, _ = recover(arbiter, comparison, empty=False)
        click.echo(
            f"the ledger continues as it is, at generation {state.generation}, with "
            f"{count_of(len(state.leases), 'lease')}{settle}"
        )
        return
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
        f"the ledger now holds {count_of(len(state.leases), 'lease')}"
        + (f" and poisons {', '.join(t for t, _ in state.poisoned)}" if state.poisoned else "")
        + f"; run {cli_command('status')}, then {cli_command('restore', '--stranded')} "
        "if it shows any"
    )
