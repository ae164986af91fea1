"""`vfs TOKEN COUNT` and `vfs --configured`: a physical function's VF count, set by
the arbiter (core/vfcount.py) and only while none of its VFs is in use."""

from __future__ import annotations

import json

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App
from charly_arbiter.core.vfcount import CountDone, apply_configured, set_vf_count
from charly_arbiter.errors import EXIT_ERROR, ArbiterError


@click.command()
@click.option(
    "--configured",
    is_flag=True,
    help="Set every count arbiter.toml configures (`vfs = N`): what the reconcile unit "
    "runs at boot.",
)
@click.option("--json", "as_json", is_flag=True, help="JSON, for scripts.")
@click.argument("token", required=False, shell_complete=complete.tokens)
@click.argument("count", required=False, type=click.IntRange(0, 65535))
@click.pass_obj
def vfs(app: App, configured: bool, as_json: bool, token: str | None, count: int | None) -> None:
    """Set TOKEN's SR-IOV virtual function count to COUNT (through 0).

    Refused (exit 3) while one of its VFs is leased or open, or the physical
    function is held exclusively; a write that hangs poisons TOKEN (exit 1).
    """
    if configured == (token is not None) or (token is not None and count is None):
        raise click.UsageError("say TOKEN COUNT, or --configured")
    arbiter = app.arbiter()
    if token is not None and count is not None:
        done = set_vf_count(arbiter, token, count)
        click.echo(json.dumps(_document(done)) if as_json else _sentence(done))
        return
    results = apply_configured(arbiter)
    if as_json:
        click.echo(
            json.dumps(
                [
                    _document(result)
                    if isinstance(result, CountDone)
                    else {"token": name, "error": str(result)}
                    for name, result in results
                ]
            )
        )
    for name, result in results:
        if not as_json:
            click.echo(_sentence(result) if isinstance(result, CountDone) else f"{name}: {result}")
    if any(isinstance(result, ArbiterError) for _, result in results):
        raise click.exceptions.Exit(EXIT_ERROR)


def _document(done: CountDone) -> dict[str, object]:
    return {
        "token": done.token,
        "before": done.before,
        "count": done.count,
        "seconds": list(done.seconds),
    }


def _sentence(done: CountDone) -> str:
    if not done.seconds:
        return f"{done.token} has {done.count} VFs already"
    took = " + ".join(f"{seconds:g} s" for seconds in done.seconds)
    return f"{done.token}: {done.before} -> {done.count} VFs ({took})"
