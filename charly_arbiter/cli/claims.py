"""`acquire`, `release` and `restore`: the same functions the hook uses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App, claim_mode, interruption_report, mode_options
from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.model import CLAIMANT_KINDS, Claimant, Lease
from charly_arbiter.errors import ArbiterError, InvalidClaimant, cli_command


@click.command()
@mode_options
@click.option("--transient", is_flag=True, help="A short use, always stranded after a reboot.")
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds to wait for a release under way (default: timeouts.claim_wait).",
)
@click.argument("claimant", shell_complete=complete.claimants)
@click.argument("tokens", nargs=-1, required=True, shell_complete=complete.tokens)
@click.pass_obj
def acquire(
    app: App,
    exclusive: bool,
    shared: bool,
    transient: bool,
    wait: float | None,
    claimant: str,
    tokens: tuple[str],
) -> None:
    """Claim TOKENS for CLAIMANT (KIND:NAME), stopping what must make room."""
    mode = claim_mode(exclusive, shared)
    if mode is None:
        raise click.UsageError("say --exclusive or --shared")
    ref = Claimant.parse(claimant)
    if ref.kind not in CLAIMANT_KINDS:
        raise InvalidClaimant(claimant, f"the kind is one of {', '.join(CLAIMANT_KINDS)}")
    arbiter = app.arbiter()
    with interruption_report(arbiter, ref, "claim"):
        plan = arbiter.acquire(ref, mode, list(tokens), transient=transient, wait=wait)
    if plan.already_held:
        click.echo(f"{plan.claimant} already holds {', '.join(plan.tokens)} ({plan.mode})")
        return
    stopped = ", ".join(step.holder for step in plan.stops)
    click.echo(
        f"{plan.claimant} holds {', '.join(plan.tokens)} ({plan.mode})"
        + (f"; stopped {stopped}" if stopped else "")
    )


@click.command()
@click.option("--failed", is_flag=True, help="The claimant failed to start.")
@click.option(
    "--force", is_flag=True, help="Release even though the claimant still runs (it loses the GPU)."
)
@click.argument("claimant", shell_complete=complete.claimants)
@click.pass_obj
def release(app: App, failed: bool, force: bool, claimant: str) -> None:
    """Release CLAIMANT's lease; the last lease on a GPU sends it home.

    Refused (exit 3) while the claimant still runs, unless --force.
    """
    ref = Claimant.parse(claimant)
    arbiter = app.arbiter()
    with interruption_report(arbiter, ref, "release"):
        released = arbiter.release_claimant(ref, success=not failed, force=force)
    if not released:
        click.echo(f"{claimant} holds no lease")
        return
    _left_behind(arbiter, [claimant])
    click.echo(f"released {claimant}")


@click.command()
@click.option("--stranded", is_flag=True, help="Every stranded claimant (the default).")
@click.option("--dry-run", is_flag=True, help="Only say which claimants would be restored.")
@click.option("--force", is_flag=True, help="Restore named claimants even though they still run.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.argument("claimants", nargs=-1, shell_complete=complete.claimants)
@click.pass_obj
def restore(
    app: App, stranded: bool, dry_run: bool, force: bool, as_json: bool, claimants: tuple[str]
) -> None:
    """Bring the host back: restore what leases stopped, send GPUs home, drop the leases.

    A named claimant that still runs is refused (exit 3) unless --force.
    """
    if stranded and claimants:
        raise click.UsageError("give either --stranded or claimant names, not both")
    refs = [Claimant.parse(claimant) for claimant in claimants]
    arbiter = app.arbiter()
    before = arbiter.ledger.read()
    with interruption_report(arbiter, None, "restore"):
        done = arbiter.restore(refs or None, dry_run=dry_run, force=force)
    if as_json:
        leases = [lease for lease in (before.lease_of(c) for c in done) if lease is not None]
        click.echo(json.dumps(_restore_document(leases, dry_run), indent=2, sort_keys=True))
    if not dry_run:
        _left_behind(arbiter, done)
    if not as_json:
        verb = "would restore" if dry_run else "restored"
        click.echo(f"{verb} {', '.join(done)}" if done else _nothing_to_restore(arbiter, refs))


def _nothing_to_restore(arbiter: Arbiter, named: Sequence[Claimant]) -> str:
    """What an empty restore says, and, for --stranded, the claimants that do not run but
    were claimed too recently to be stranded: a restore run right after a VM's stop
    would otherwise look like a lease that is never taken."""
    if named:
        return "nothing to restore"
    waiting = arbiter.not_running_yet(arbiter.ledger.read())
    if not waiting:
        return "nothing to restore"
    grace = arbiter.config.timeouts.claim_grace
    names = ", ".join(f"{c} (claimed {age:.1f} s ago)" for c, age in sorted(waiting.items()))
    verb = "does" if len(waiting) == 1 else "do"
    return (
        f"nothing to restore yet: {names} {verb} not run, but a lease is stranded only "
        f"{grace:g} s after its claim (timeouts.claim_grace: a VM about to start does "
        "not run yet); run this again then"
    )


def _restore_document(leases: Sequence[Lease], dry_run: bool) -> dict[str, Any]:
    """Each lease as it was before the restore: what it held, and the holders it had
    stopped, which the restore starts again (unless another lease now holds their GPU)."""
    return {
        "dry_run": dry_run,
        "claimants": [
            {
                "claimant": lease.claimant,
                "mode": str(lease.mode),
                "tokens": list(lease.tokens),
                "state": str(lease.state),
                "start_again": [record.holder for record in lease.unrestored()],
            }
            for lease in leases
        ],
    }


def _left_behind(arbiter: Arbiter, claimants: Sequence[str]) -> None:
    """Fail when a release could not finish (a GPU that did not go home, a holder
    that did not start): its lease stays for `restore`, and the operator must know."""
    state = arbiter.ledger.read()
    left = [claimant for claimant in claimants if state.lease_of(claimant) is not None]
    if left:
        raise ArbiterError(
            f"{', '.join(left)}: not everything came back (see the messages above); "
            "the lease is kept",
            hint=f"fix the cause, then run {cli_command('restore', operands=left)}",
        )
