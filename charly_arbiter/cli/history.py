"""`history`: what happened to the GPUs, from the event log in the state directory."""

from __future__ import annotations

import json

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App
from charly_arbiter.core.events import describe
from charly_arbiter.core.model import Claimant, human_time
from charly_arbiter.ops.history import HistoryLog, Record, interrupted, parse_since, select


@click.command()
@click.option(
    "--token",
    metavar="TOKEN",
    help="Only what concerns this token.",
    shell_complete=complete.tokens,
)
@click.option(
    "--claimant",
    metavar="KIND:NAME",
    help="Only what this claimant did or suffered.",
    shell_complete=complete.claimants,
)
@click.option("--since", metavar="WHEN", help="Only newer events: 30m, 2h, 1d, or an ISO time.")
@click.option("--json", "as_json", is_flag=True, help="A JSON array of events, for scripts.")
@click.pass_obj
def history(
    app: App, token: str | None, claimant: str | None, since: str | None, as_json: bool
) -> None:
    """Show claims, refusals, preemptions, switches, restores and poisonings, oldest first."""
    when = parse_since(since) if since else None
    ref = Claimant.parse(claimant) if claimant is not None else None
    reading = HistoryLog(app.config().state_dir).read()
    if token is not None and not any(token in record.tokens for record in reading.records):
        # Neither in the history nor configured: a name that names nothing (exit 2).
        app.arbiter().tokens.resolve([token])
    for note in reading.notes:
        click.echo(f"note: {note}", err=True)
    killed = {id(reading.records[i]) for i in interrupted(reading.records)}
    records = select(reading.records, token=token, claimant=ref, since=when)
    if as_json:
        documents = [
            {
                **record.document(),
                "message": describe(record.kind, record.fields),
                "interrupted": id(record) in killed,
            }
            for record in records
        ]
        click.echo(json.dumps(documents, indent=2, ensure_ascii=False))
        return
    if not records:
        click.echo("no events")
    for record in records:
        click.echo(render(record, interrupted=id(record) in killed))


def render(record: Record, interrupted: bool = False) -> str:
    line = f"{human_time(record.time)}  {record.kind:<14} {describe(record.kind, record.fields)}"
    if interrupted:
        line += f"  [INTERRUPTED: process {record.pid} died during this step]"
    return line
