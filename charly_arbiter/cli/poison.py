"""`poison list` and `poison clear`: only an operator un-poisons a GPU."""

from __future__ import annotations

import json

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App, needs_subcommand
from charly_arbiter.core.model import human_time


@click.group(invoke_without_command=True, no_args_is_help=False)
@click.pass_context
def poison(ctx: click.Context) -> None:
    """GPUs whose driver switch failed, kept out of use until cleared."""
    needs_subcommand(ctx)


@poison.command("list")
@click.option("--json", "as_json", is_flag=True, help="A JSON array, for scripts.")
@click.pass_obj
def list_poisoned(app: App, as_json: bool) -> None:
    """List poisoned tokens with the reason and the time."""
    state = app.ledger().read()
    if as_json:
        documents = [
            {"token": token, "reason": record.reason, "since": record.since}
            for token, record in state.poisoned
        ]
        click.echo(json.dumps(documents, indent=2, ensure_ascii=False))
        return
    if not state.poisoned:
        click.echo("no token is poisoned")
    for token, record in state.poisoned:
        click.echo(f"{token}: since {human_time(record.since)}: {record.reason}")


@poison.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.argument("token", shell_complete=complete.tokens)
@click.pass_obj
def clear(app: App, as_json: bool, token: str) -> None:
    """Clear TOKEN's poison after checking the GPU and its driver by hand."""
    arbiter = app.arbiter()
    if arbiter.ledger.read().poison_of(token) is None:
        # Not poisoned: fine for a token that exists, a usage error (exit 2, naming the
        # known ones) for a name that names nothing.  A poisoned token the configuration
        # no longer names can still be cleared.
        arbiter.tokens.resolve([token])
    cleared = arbiter.clear_poison(token)
    if as_json:
        click.echo(json.dumps({"token": token, "cleared": cleared}, sort_keys=True))
    elif cleared:
        click.echo(f"cleared the poison of {token}")
    else:
        click.echo(f"{token} is not poisoned")
