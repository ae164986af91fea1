"""`poison list` and `poison clear`: only an operator un-poisons a GPU."""

from __future__ import annotations

import click

from charly_arbiter.cli.app import App


@click.group()
def poison() -> None:
    """GPUs whose driver switch failed, kept out of use until cleared."""


@poison.command("list")
@click.pass_obj
def list_poisoned(app: App) -> None:
    """List poisoned tokens with the reason and the time."""
    state = app.ledger().read()
    if not state.poisoned:
        click.echo("no token is poisoned")
    for token, record in state.poisoned:
        click.echo(f"{token}: since {record.since}: {record.reason}")


@poison.command()
@click.argument("token")
@click.pass_obj
def clear(app: App, token: str) -> None:
    """Clear TOKEN's poison after checking the GPU and its driver by hand."""
    if app.arbiter().clear_poison(token):
        click.echo(f"cleared the poison of {token}")
    else:
        click.echo(f"{token} is not poisoned")
