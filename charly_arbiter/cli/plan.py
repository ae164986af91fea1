"""`plan`: what an `acquire` would do right now, without doing any of it.

It asks `Arbiter.plan`, which runs the same `decide_claim` as `acquire` over
the live host and ledger, so a plan cannot disagree with the claim it
previews.  A refusal exits 3, like `acquire`.  `plan libvirt:NAME` alone
reads the domain's claim from its libvirt definition, as its start would.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App, claim_mode, mode_options
from charly_arbiter.compose import real_kinds
from charly_arbiter.core.host import NO_DRIVER
from charly_arbiter.core.model import Claimant
from charly_arbiter.core.planner import ClaimPlan
from charly_arbiter.errors import ClaimRefused, NeedsHost, cli_command


@click.command()
@mode_options
@click.option("--transient", is_flag=True, help="Plan a transient claim.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.argument("claimant", shell_complete=complete.claimants)
@click.argument("tokens", nargs=-1, shell_complete=complete.tokens)
@click.pass_obj
def plan(
    app: App,
    exclusive: bool,
    shared: bool,
    transient: bool,
    as_json: bool,
    claimant: str,
    tokens: tuple[str],
) -> None:
    """Show what claiming TOKENS for CLAIMANT would stop and switch; change nothing.

    With a libvirt domain (libvirt:NAME) and no mode or tokens: what starting it
    would do, its claim read from its definition as the hook reads it.
    """
    mode = claim_mode(exclusive, shared)
    if not tokens and (mode is not None or transient):
        raise click.UsageError("name the TOKENS to claim")
    if tokens and mode is None:
        raise click.UsageError("say --exclusive or --shared")
    ref = Claimant.parse(claimant)
    try:
        if mode is not None:
            result = app.arbiter().plan(ref, mode, list(tokens), transient=transient)
        else:
            from charly_arbiter.libvirt.preview import preview_start

            _needs_libvirt(app, ref)
            found = preview_start(app.arbiter(), ref)
            if found is None:
                _no_claim(claimant, as_json)
                return
            result = found
    except ClaimRefused as refusal:
        if as_json:
            document = {"claimant": claimant, "refused": refusal.why, "hint": refusal.hint}
            click.echo(json.dumps(document, indent=2, sort_keys=True))
        else:
            click.echo(f"{claimant} would be refused: {refusal}")
            if refusal.hint:
                click.echo(f"hint: {refusal.hint}")
        sys.exit(refusal.exit_code)
    if as_json:
        planned = {**plan_document(result), "from_definition": not tokens}
        click.echo(json.dumps(planned, indent=2, sort_keys=True))
    else:
        click.echo(render(result))


def _needs_libvirt(app: App, ref: Claimant) -> None:
    """A domain's definition comes from libvirt: a simulated host asks this machine's
    libvirtd only when its host.toml lists libvirt among its real holders."""
    if ref.kind != "libvirt":
        return  # preview_start says what to give instead
    kinds = real_kinds(app.host())
    if kinds is not None and "libvirt" not in kinds:
        raise NeedsHost(
            f"plan {ref}",
            f"libvirt, which holds the domain's definition, and {app.host().description} has none",
            "name the mode and the tokens ("
            + cli_command("plan", "--exclusive", operands=[ref, "TOKEN"])
            + '), or add real_holders = ["libvirt"] to the simulated host\'s host.toml',
        )


def _no_claim(claimant: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"claimant": claimant, "claims_nothing": True}, sort_keys=True))
    else:
        click.echo(f"{claimant} claims no GPU: starting it changes nothing here.")


def plan_document(result: ClaimPlan) -> dict[str, Any]:
    return {
        "claimant": result.claimant,
        "mode": str(result.mode),
        "tokens": list(result.tokens),
        "already_held": result.already_held,
        "stops": [
            {"holder": s.holder, "how": s.how, "shared_tokens": list(s.shared_tokens)}
            for s in result.stops
        ],
        "switches": [
            {"token": s.token, "address": s.address, "from": s.from_driver, "to": s.to_driver}
            for s in result.switches
        ],
        "takes_over_leases_of": list(result.preempted_leases),
        "regenerates_cdi_for": list(result.cdi_tokens),
    }


def render(result: ClaimPlan) -> str:
    tokens = ", ".join(result.tokens)
    if result.already_held:
        return f"{result.claimant} already holds {tokens} ({result.mode}): nothing to do"
    lines = [f"{result.claimant} can claim {tokens} ({result.mode}{_transient(result)})."]
    if result.stops:
        lines.append("It would stop, in this order:")
        for step in result.stops:
            shared = f", whose shared lease on {', '.join(step.shared_tokens)} it takes over"
            lines.append(f"  {step.holder} ({step.how}{shared if step.shared_tokens else ''})")
    else:
        lines.append("It would stop nothing.")
    if result.switches:
        lines.append("It would switch:")
        width = max(len(s.from_driver or "(no driver)") for s in result.switches)
        for switch in result.switches:
            before = switch.from_driver or "(no driver)"
            after = switch.to_driver if switch.to_driver != NO_DRIVER else "(the kernel's choice)"
            lines.append(f"  {switch.token} {switch.address}  {before:<{width}} -> {after}")
    else:
        lines.append("It would switch no driver.")
    if result.stops:
        names = ", ".join(step.holder for step in result.stops)
        lines.append(f"When {result.claimant} releases {tokens}, {names} would be started again.")
    if result.cdi_tokens:
        lines.append(f"The CDI spec would be regenerated for {', '.join(result.cdi_tokens)}.")
    lines.append("Nothing was changed (this is a plan).")
    return "\n".join(lines)


def _transient(result: ClaimPlan) -> str:
    return ", transient" if result.transient else ""
