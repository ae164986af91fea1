"""`adopt` and `send-home`: an operator's decision about a GPU the ledger does not
account for (on vfio-pci with no lease and no poison: the ledger was deleted or
replaced while it was passed through, or something else bound it there).

Until one of them (or `recover`, for a ledger that went backwards) has run, every
command that would act on that GPU is refused (exit 3).  What the history says
held it, and what it had stopped, is shown by `explain TOKEN`.
"""

from __future__ import annotations

import click

from charly_arbiter.cli.app import App
from charly_arbiter.errors import cli_command
from charly_arbiter.ops.history import HistoryLog
from charly_arbiter.ops.reconcile import adopt as adopt_token
from charly_arbiter.ops.reconcile import adopt_admin, send_home


@click.command()
@click.option(
    "--admin",
    is_flag=True,
    help="It is on vfio-pci on purpose (bound at boot): record vfio-pci as its home.",
)
@click.argument("token")
@click.argument("claimant", required=False, metavar="[KIND:NAME]")
@click.pass_obj
def adopt(app: App, admin: bool, token: str, claimant: str | None) -> None:
    """Record who holds TOKEN, found on vfio-pci with no lease: KIND:NAME (the VM that
    uses it) holds it exclusively, or, with --admin, it stays on vfio-pci on purpose.

    The holders the history says were stopped for it are recorded too: they are
    started again when its lease ends.  Refused (exit 3) for a token the ledger
    accounts for already.
    """
    if admin == (claimant is not None):
        raise click.UsageError("give either KIND:NAME or --admin")
    arbiter = app.arbiter()
    if admin:
        adopt_admin(arbiter, token)
        click.echo(
            f"{token} stays on vfio-pci on purpose: exclusive claims take it as it is, "
            "releases leave it there, shared claims are refused; "
            f"{cli_command('send-home', operands=[token])} undoes it"
        )
        return
    assert claimant is not None
    history = HistoryLog(app.config().state_dir).read().records
    adopted = adopt_token(arbiter, token, claimant, history)
    lease = adopted.lease
    line = f"{lease.claimant} now holds {', '.join(lease.tokens)} (exclusive)"
    if adopted.stopped:
        line += f"; {', '.join(adopted.stopped)} will be started again when it releases"
    click.echo(line)
    if not adopted.runs:
        click.echo(
            f"{lease.claimant} does not run: its lease is stranded, and "
            f"{cli_command('restore', operands=[lease.claimant])} sends {token} home"
        )


@click.command("send-home")
@click.option(
    "--force",
    is_flag=True,
    help="Even though the history says a claimant that still runs holds it.",
)
@click.argument("token")
@click.pass_obj
def send_home_command(app: App, force: bool, token: str) -> None:
    """Send TOKEN, found on vfio-pci with no lease (or kept there by `adopt --admin`),
    to its home driver, and start again what the history says was stopped for it.

    Refused (exit 3) while the claimant the history says holds it still runs,
    unless --force.
    """
    arbiter = app.arbiter()
    history = HistoryLog(app.config().state_dir).read().records
    _, started = send_home(arbiter, token, history, force=force)
    click.echo(f"sent {token} home" + (f"; started {', '.join(started)} again" if started else ""))
