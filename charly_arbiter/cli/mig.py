"""`mig TOKEN [on|off|layout PROFILE,...]`: a GPU's MIG mode and instances, shown or
changed (core/migop.py: an exclusive claim of the arbiter's own makes room)."""

from __future__ import annotations

import json
from typing import Any

import click

from charly_arbiter.cli import complete
from charly_arbiter.cli.app import App
from charly_arbiter.core.host import MigChange, MigState
from charly_arbiter.core.migop import change_mig, mig_state


@click.command()
@click.option("--json", "as_json", is_flag=True, help="JSON, for scripts.")
@click.argument("token", shell_complete=complete.tokens)
@click.argument("action", required=False, type=click.Choice(["on", "off", "layout"]))
@click.argument("profiles", required=False)
@click.pass_obj
def mig(app: App, as_json: bool, token: str, action: str | None, profiles: str | None) -> None:
    """Show TOKEN's MIG instances, or turn MIG on or off, or lay it out anew
    (`layout 3g.40gb,2g.20gb,1g.10gb`): its holders are stopped first and brought back.

    Each instance N is the sub-token TOKEN:N, which containers claim shared (NVIDIA's
    CDI names it GPU:N)."""
    if (action == "layout") != (profiles is not None):
        raise click.UsageError("say layout PROFILE,... (and PROFILE,... only after layout)")
    arbiter = app.arbiter()
    if action is None:
        state = mig_state(arbiter, token)
        click.echo(json.dumps(_document(token, state)) if as_json else _lines(token, state))
        return
    change = (
        MigChange(layout=tuple(p.strip() for p in (profiles or "").split(",") if p.strip()))
        if action == "layout"
        else MigChange(enabled=action == "on")
    )
    done = change_mig(arbiter, token, change)
    if as_json:
        document = _document(token, done.after)
        document["stopped"] = list(done.stopped)
        click.echo(json.dumps(document))
        return
    stopped = ", ".join(done.stopped)
    click.echo(
        f"{token}: MIG {change}" + (f" (stopped and brought back {stopped})" if stopped else "")
    )
    click.echo(_lines(token, done.after))


def _document(token: str, state: MigState) -> dict[str, Any]:
    return {
        "token": token,
        "enabled": state.enabled,
        "pending": state.pending,
        "index": state.index,
        "instances": [
            {
                "sub_token": f"{token}:{i.index}",
                "cdi": f"nvidia.com/gpu={state.index}:{i.index}",
                "profile": i.profile,
                "uuid": i.uuid,
                "gpu_instance": i.gpu_instance,
                "compute_instance": i.compute_instance,
            }
            for i in state.instances
        ],
    }


def _lines(token: str, state: MigState) -> str:
    mode = "on" if state.enabled else "off"
    lines = [
        f"{token}: MIG {mode}" + (" (another mode is pending a reset)" if state.pending else "")
    ]
    lines += [
        f"  {token}:{i.index}  {i.profile}  {i.uuid}  (CDI nvidia.com/gpu={state.index}:{i.index})"
        for i in state.instances
    ]
    return "\n".join(lines)
