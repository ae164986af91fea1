"""`explain TOKEN|CLAIMANT`: what holds it, what was stopped, what went wrong, the fix."""

from __future__ import annotations

from datetime import UTC, datetime

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App
from charly_arbiter.core.model import Claimant
from charly_arbiter.errors import ArbiterError
from charly_arbiter.ops import history
from charly_arbiter.ops.explain import Facts, explain_claimant, explain_token


@click.command()
@click.argument("subject", metavar="TOKEN|CLAIMANT", shell_complete=complete.token_or_claimant)
@click.pass_obj
def explain(app: App, subject: str) -> None:
    """Explain a token's or a claimant's state in sentences, with the command that fixes it."""
    arbiter = app.arbiter()
    # A token first: one named after its address (no tokens configured) has colons too.
    is_claimant = ":" in subject and subject not in arbiter.tokens.all()
    if is_claimant:
        subject = Claimant.parse(subject)
    else:
        arbiter.tokens.resolve([subject])  # an unknown token: exit 2, listing the known ones
    status = arbiter.status()
    if status.corrupt:
        click.echo(f"The ledger is corrupt: {status.corrupt}.")
    reading = history.HistoryLog(app.config().state_dir).read()
    for note in reading.notes:
        click.echo(f"note: {note}", err=True)
    screens = {}
    if not is_claimant:
        spec = arbiter.tokens.all()[subject]
        try:
            screens[subject] = (app.host().screen(spec), spec.screen)
        except ArbiterError as error:  # the rest of the story still helps
            click.echo(f"note: who uses its screen is unknown: {error}", err=True)
    facts = Facts(
        status=status,
        boot_id=app.host().boot_id(),
        history=reading.records,
        interrupted=frozenset(history.interrupted(reading.records)),
        now=datetime.now(UTC),
        screens=screens,
    )
    sentences = explain_claimant(subject, facts) if is_claimant else explain_token(subject, facts)
    click.echo("\n".join(sentences))
