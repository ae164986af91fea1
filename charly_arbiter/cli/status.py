"""`status`: every lease, every token's state, and the stranded claimants."""

from __future__ import annotations

import json
from typing import Any

import click

from charly_arbiter.arbiter import Status
from charly_arbiter.cli.app import App


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.pass_obj
def status(app: App, as_json: bool) -> None:
    """Show leases, tokens (mode, driver, poison) and stranded claimants."""
    result = app.arbiter().status()
    if as_json:
        click.echo(json.dumps(status_document(result), indent=2, sort_keys=True))
    else:
        click.echo(render(result))
    if result.corrupt:
        raise SystemExit(1)


def status_document(result: Status) -> dict[str, Any]:
    return {
        "generation": result.generation,
        "corrupt": result.corrupt,
        "leases": [
            {
                "claimant": lease.claimant,
                "mode": str(lease.mode),
                "tokens": list(lease.tokens),
                "state": str(lease.state),
                "transient": lease.transient,
                "created": lease.created,
                "stopped": [record.holder for record in lease.stopped if not record.restored],
            }
            for lease in result.leases
        ],
        "tokens": {
            token.name: {
                "address": token.address,
                "mode": token.mode,
                "driver": dict(token.drivers).get(token.address),
                "drivers": {address: driver for address, driver in token.drivers},
                "claimants": list(token.claimants),
                "poisoned": token.poisoned,
                "reason": token.reason,
            }
            for token in result.tokens
        },
        "stranded": list(result.stranded),
    }


def render(result: Status) -> str:
    lines = []
    if result.corrupt:
        lines += [f"LEDGER CORRUPT: {result.corrupt}", ""]
    lines.append(f"{'TOKEN':<14} {'MODE':<10} {'DRIVERS':<44} CLAIMANTS")
    for token in result.tokens:
        drivers = " ".join(f"{addr[-7:]}={driver or '-'}" for addr, driver in token.drivers)
        claimants = ", ".join(token.claimants) or "-"
        lines.append(f"{token.name:<14} {token.mode:<10} {drivers:<44} {claimants}")
        if token.poisoned:
            lines.append(f"{'':<14} POISONED since {token.since}: {token.reason}")
    lines.append("")
    if not result.leases:
        lines.append("no leases")
    for lease in result.leases:
        stopped = [r.holder for r in lease.stopped if not r.restored]
        mark = " STRANDED" if lease.claimant in result.stranded else ""
        lines.append(
            f"{lease.claimant}: {lease.mode} {', '.join(lease.tokens)} "
            f"({lease.state}{', transient' if lease.transient else ''}) since {lease.created}"
            f"{mark}" + (f"; stopped {', '.join(stopped)}" if stopped else "")
        )
    if result.stranded:
        lines += ["", "stranded: " + ", ".join(result.stranded)]
        lines.append("hint: run `charly-arbiter restore --stranded`")
    return "\n".join(lines)
