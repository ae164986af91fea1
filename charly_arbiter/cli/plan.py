"""`plan`: what an `acquire` (or, with `--release`, a `release`) would do right now,
without doing any of it.

It asks `Arbiter.plan`, which runs the same `decide_claim` as `acquire` over
the live host and ledger, so a plan cannot disagree with the claim it
previews.  A refusal exits 3, like `acquire`.  `plan libvirt:NAME` alone
reads the domain's claim from its libvirt definition, as its start would.
`plan --release CLAIMANT` asks `Arbiter.plan_release`, the same
`decide_release` a release runs (core/release_planner.py); a release that
would be refused (its claimant still runs, another process is carrying its
lease out) exits 3.
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
from charly_arbiter.core.model import Claimant, HolderKind
from charly_arbiter.core.planner import ClaimPlan
from charly_arbiter.core.release_planner import ComebackWay, End, HomeWay, ReleasePlan
from charly_arbiter.errors import (
    ClaimantRunning,
    ClaimRefused,
    LeaseInProgress,
    NeedsHost,
    ScreenInUse,
    cli_command,
)


@click.command()
@mode_options
@click.option("--transient", is_flag=True, help="Plan a transient claim.")
@click.option(
    "--release",
    "releasing",
    is_flag=True,
    help="Plan CLAIMANT's release instead: what goes home, who comes back.",
)
@click.option(
    "--force", is_flag=True, help="With --release: as `release --force` (it may still run)."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.argument("claimant", shell_complete=complete.claimants)
@click.argument("tokens", nargs=-1, shell_complete=complete.tokens)
@click.pass_obj
def plan(
    app: App,
    exclusive: bool,
    shared: bool,
    transient: bool,
    releasing: bool,
    force: bool,
    as_json: bool,
    claimant: str,
    tokens: tuple[str],
) -> None:
    """Show what claiming TOKENS for CLAIMANT would stop and switch; change nothing.

    With a libvirt domain (libvirt:NAME) and no mode or tokens: what starting it
    would do, its claim read from its definition as the hook reads it.  With
    --release: what releasing CLAIMANT's lease would do.
    """
    mode = claim_mode(exclusive, shared)
    if releasing:
        if tokens or mode is not None or transient:
            raise click.UsageError("--release takes a claimant only (no mode, no tokens)")
        _plan_release(app, claimant, force, as_json)
        return
    if force:
        raise click.UsageError("--force goes with --release")
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
            document: dict[str, Any] = {
                "claimant": claimant,
                "refused": refusal.why,
                "hint": refusal.hint,
            }
            if isinstance(refusal, ScreenInUse):
                document["screen"] = {"holder": refusal.holder, "users": list(refusal.users)}
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
    if ref.kind != HolderKind.LIBVIRT:
        return  # preview_start says what to give instead
    kinds = real_kinds(app.host())
    if kinds is not None and HolderKind.LIBVIRT not in kinds:
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
        "screens": {token: use.as_json() for token, use in sorted(result.screens.items())},
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
        width = max(len(_from(s.from_driver)) for s in result.switches)
        for switch in result.switches:
            before, after = _from(switch.from_driver), _to(switch.to_driver)
            lines.append(f"  {switch.token} {switch.address}  {before:<{width}} -> {after}")
    else:
        lines.append("It would switch no driver.")
    if result.stops:
        names = ", ".join(step.holder for step in result.stops)
        lines.append(f"When {result.claimant} releases {tokens}, {names} would be started again.")
    if result.cdi_tokens:
        lines.append(f"The CDI spec would be regenerated for {', '.join(result.cdi_tokens)}.")
    for use in result.screens.values():
        lines.append(f"It takes a screen: {use.describe()}.")
    lines.append("Nothing was changed (this is a plan).")
    return "\n".join(lines)


def _from(driver: str | None) -> str:
    return driver or "(no driver)"


def _to(driver: str) -> str:
    return driver if driver != NO_DRIVER else "(the kernel's choice)"


def _transient(result: ClaimPlan) -> str:
    return ", transient" if result.transient else ""


# -- plan --release -------------------------------------------------------------------------


def _plan_release(app: App, claimant: str, force: bool, as_json: bool) -> None:
    try:
        result = app.arbiter().plan_release(claimant, force=force)
    except (ClaimantRunning, LeaseInProgress) as refusal:
        if as_json:
            document = {
                "claimant": claimant,
                "release": True,
                "refused": refusal.message,
                "hint": refusal.hint,
            }
            click.echo(json.dumps(document, indent=2, sort_keys=True))
        else:
            click.echo(f"releasing {claimant} would be refused: {refusal}")
            if refusal.hint:
                click.echo(f"hint: {refusal.hint}")
        sys.exit(3)
    if result is None:
        if as_json:
            document = {"claimant": claimant, "release": True, "holds_no_lease": True}
            click.echo(json.dumps(document, sort_keys=True))
        else:
            click.echo(f"{claimant} holds no lease: releasing it changes nothing.")
        return
    if as_json:
        click.echo(json.dumps(release_document(result), indent=2, sort_keys=True))
    else:
        click.echo(render_release(result))


def _returns(result: ReleasePlan) -> dict[str, tuple[str, ...]]:
    """The shared lease each holder started again gets back (the projection's order)."""
    started = [c for c in result.comebacks if c.way is ComebackWay.START]
    return {
        comeback.record.holder: returned.tokens
        for comeback, returned in zip(started, result.returns, strict=True)
    }


def release_document(result: ReleasePlan) -> dict[str, Any]:
    before = result.before
    back = _returns(result)
    return {
        "claimant": result.claimant,
        "release": True,
        "lease": {
            "mode": str(before.mode),
            "tokens": list(before.tokens),
            "state": str(before.state),
        },
        "ends_at_once": result.lease is None,
        "home": [
            {
                "token": step.token,
                "way": str(step.way),
                "switches": [
                    {"address": s.address, "from": s.from_driver, "to": s.to_driver}
                    for s in step.switches
                ],
            }
            for step in result.homes
        ],
        "hand_over": [{"holder": h.record.holder, "to": h.heir} for h in result.handovers],
        "come_back": [
            {
                "holder": c.record.holder,
                "way": str(c.way),
                "to": c.to,
                "why": c.why,
                "shared_lease": list(back.get(c.record.holder, ())),
            }
            for c in result.comebacks
        ],
        "lease_kept": result.end is End.INCOMPLETE,
    }


_HOME_LINES = {
    HomeWay.HOME: "{token} is home already",
    HomeWay.POISONED: "leave {token} where it is: it is poisoned ({clear} once it has been "
    "checked)",
    HomeWay.UNKNOWN: "leave {token} where it is: it is no longer configured",
    HomeWay.SHARED: "leave {token} home: another lease still uses it",
    HomeWay.UNTOUCHED: "leave {token} alone: the claim never switched it",
    HomeWay.GONE_HOME: "{token} went home already",
}


def render_release(result: ReleasePlan) -> str:
    before = result.before
    tokens = ", ".join(before.tokens)
    lines = [f"Releasing {result.claimant} ({before.mode} lease on {tokens}, {before.state}):"]
    for step in result.homes:
        if step.way is HomeWay.SWITCH:
            moves = ", ".join(
                f"{s.address} {_from(s.from_driver)} -> {_to(s.to_driver)}" for s in step.switches
            )
            lines.append(f"  send {step.token} home: {moves}")
        else:
            clear = cli_command("poison", "clear", operands=[step.token])
            lines.append("  " + _HOME_LINES[step.way].format(token=step.token, clear=clear))
    for handover in result.handovers:
        lines.append(
            f"  hand {handover.record.holder} to {handover.heir}, which stays on the GPU "
            "(it brings it back when it goes)"
        )
    back = _returns(result)
    for comeback in result.comebacks:
        holder = comeback.record.holder
        if comeback.way is ComebackWay.START:
            shared = back.get(holder, ())
            with_lease = f", with its shared lease on {', '.join(shared)}" if shared else ""
            check = (
                ", and check that it draws on its GPU (else a text login on the console)"
                if holder.kind is HolderKind.DISPLAY_MANAGER
                else ""
            )
            lines.append(f"  start {holder} again{with_lease}{check}")
        elif comeback.way is ComebackWay.ENDED:
            lines.append(f"  {holder} is not started again: {comeback.why}")
        elif comeback.way is ComebackWay.LEFT:
            lines.append(f"  leave {holder} to {comeback.to}, which stopped it too")
        else:
            lines.append(f"  keep {holder} stopped: {comeback.why}")
    if result.lease is None:
        lines.append("The lease ends at once: every GPU it holds stays in use.")
    elif result.end is End.INCOMPLETE:
        restore = cli_command("restore", operands=[result.claimant])
        lines.append(f"The lease would stay, for {restore} once what is missing is fixed.")
    else:
        lines.append("Then the lease is gone.")
    lines.append("Nothing was changed (this is a plan).")
    return "\n".join(lines)
