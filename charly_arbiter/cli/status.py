"""`status`: every lease, every token's state, and the stranded claimants.

The human rendering is a small table per token (its functions' drivers, then
its leases with their age and what they stopped), read at a glance; colour
only when stdout is a terminal.  `--json` is the stable interface for scripts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import unicodedata
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import click

from charly_arbiter.cli.app import App
from charly_arbiter.core.arbiter import Status, TokenStatus, rollback_found
from charly_arbiter.core.config import HolderConfig
from charly_arbiter.core.host import Holder
from charly_arbiter.core.model import Lease, human_time
from charly_arbiter.core.planner import unaccounted_hint
from charly_arbiter.errors import cli_command
from charly_arbiter.ops.explain import age, stranded_why
from charly_arbiter.ops.follow import FileWakeup, follow
from charly_arbiter.ops.history import HISTORY


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.option(
    "--follow",
    "following",
    is_flag=True,
    help="With --json: one line per change (ledger, history, or the state found every "
    "--interval seconds) until the reader goes away.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=1),
    default=10.0,
    show_default=True,
    help="With --follow: seconds between checks of what no file records "
    "(a claimant that stopped running).",
)
@click.pass_obj
def status(app: App, as_json: bool, following: bool, interval: float) -> None:
    """Show leases, tokens (mode, driver, poison) and stranded claimants."""
    if following:
        if not as_json:
            raise click.UsageError("--follow needs --json")
        _follow(app, interval)
        return
    result = app.arbiter().status()
    attached = [holder for holder in app.config().holders if holder.attached is not None]
    if as_json:
        # Indented for a person; one line for a program (json's C encoder, which
        # indenting bypasses, is ten times faster with many leases).
        indent = 2 if sys.stdout.isatty() else None
        document = status_document(result, attached)
        click.echo(json.dumps(document, indent=indent, sort_keys=True))
    else:
        click.echo(render(result, colour=sys.stdout.isatty(), attached=attached))
    if result.corrupt:
        raise SystemExit(1)


def _follow(app: App, interval: float) -> None:
    """`--json --follow`: compact lines on stdout, flushed, until its reader closes it."""
    arbiter = app.arbiter()
    state_dir = app.config().state_dir
    attached = [holder for holder in app.config().holders if holder.attached is not None]

    def produce() -> str:
        return json.dumps(status_document(arbiter.status(), attached), sort_keys=True)

    def emit(text: str) -> bool:
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            # Nobody reads any more; point stdout at /dev/null so exiting cannot fail.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return False
        return True

    watched = [arbiter.ledger.path, state_dir / HISTORY]
    # Ctrl-C is how a person stops a follower: its normal end, exit 0.
    with contextlib.suppress(KeyboardInterrupt):
        follow(
            produce,
            watched,
            emit,
            interval=interval,
            wakeup=lambda: FileWakeup(watched, reader=sys.stdout.fileno()),
        )


def status_document(result: Status, attached: Sequence[HolderConfig] = ()) -> dict[str, Any]:
    return {
        "attached": [
            {
                "unit": holder.ref,
                "tokens": list(holder.tokens),
                "mode": holder.mode,
                "preemptible": holder.preemptible,
                "dropin": str(holder.dropin or ""),
            }
            for holder in attached
        ],
        "generation": result.generation,
        "history_generation": result.history_generation,
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
                "stranded_why": (
                    stranded_why(lease, result.boot_id) if lease.claimant in result.stranded else ""
                ),
                "sleep_locks": list(lease.sleep_locks),
                "sleep_lock_error": lease.sleep_lock_error,
            }
            for lease in result.leases
        ],
        "sleep": {
            "policy": result.sleep.policy,
            "locks": dict(result.sleep.locks),
            "missing": list(result.sleep.missing),
            "unavailable": result.sleep.unavailable or None,
        },
        "tokens": {
            token.name: {
                "address": token.address,
                "mode": token.mode,
                "driver": dict(token.drivers).get(token.address),
                "drivers": {address: driver for address, driver in token.drivers},
                "claimants": list(token.claimants),
                "users": [
                    {
                        "holder": holder.ref,
                        "preemptible": holder.preemptible,
                        "passthrough": holder.passthrough,
                    }
                    for holder in token.users
                ],
                "unaccounted": list(token.unaccounted),
                "bound_by_admin": token.bound_by_admin,
                "virtual_functions": list(token.virtual_functions),
                "total_vfs": token.total_vfs,
                "physical_function": token.physical_function,
                "absent": token.absent,
                "poisoned": token.poisoned,
                "reason": token.reason,
                "since": token.since,
                "sleep_blocked": result.sleep.lock_of(token.name),
            }
            for token in result.tokens
        },
        "stranded": list(result.stranded),
    }


Style = Callable[[str, str], str]

_COLOURS: dict[str, dict[str, Any]] = {
    "exclusive": {"fg": "yellow", "bold": True},
    "shared": {"fg": "cyan"},
    "idle": {"fg": "green"},
    "in-use": {"fg": "magenta"},
    "unaccounted": {"fg": "red", "bold": True},
    "bad": {"fg": "red", "bold": True},
    "head": {"bold": True},
}


def render(
    result: Status,
    colour: bool = False,
    now: datetime | None = None,
    attached: Sequence[HolderConfig] = (),
) -> str:
    """The table; `now` fixes the lease ages (golden tests), `colour` adds ANSI styles;
    then the units `attach` made claim by themselves."""
    style: Style = _styled if colour else _plain
    moment = now or datetime.now(UTC)
    lines: list[str] = []
    if result.corrupt:
        lines += [style(f"LEDGER CORRUPT: {result.corrupt}", "bad"), ""]
    if result.history_generation is not None:
        found = rollback_found(result.generation, result.history_generation)
        lines += [
            style(f"LEDGER WENT BACK: {found}", "bad"),
            f"hint: run {cli_command('recover')} to compare what the history says it held "
            "with the host, then decide",
            "",
        ]
    for token in result.tokens:
        lines += _token_table(token, result, style, moment)
        lines.append("")
    orphans = [
        lease
        for lease in result.leases
        if not any(lease.claimant in token.claimants for token in result.tokens)
    ]
    for lease in orphans:
        lines.append(f"lease of {lease.claimant} on {', '.join(lease.tokens)} ({lease.state})")
    if result.stranded:
        lines.append(style("stranded: " + ", ".join(result.stranded), "bad"))
        lines.append(f"hint: run {cli_command('restore', '--stranded')}")
    elif not result.leases and not result.corrupt:  # a corrupt ledger is never "no leases"
        went_back = result.history_generation is not None
        lines.append("no leases in this ledger, which went back" if went_back else "no leases")
    if attached:
        lines += ["", style("attached units", "head")]
        rows = [("UNIT", "TOKENS", "CLAIM", "DROP-IN")]
        for holder in attached:
            claim = holder.mode + ("" if holder.preemptible else ", not preemptible")
            rows.append((holder.ref, ", ".join(holder.tokens), claim, str(holder.dropin or "-")))
        lines += _table(rows, style)
    return "\n".join(lines).rstrip("\n")


def _token_table(token: TokenStatus, result: Status, style: Style, now: datetime) -> list[str]:
    lines = [f"{style(token.name, 'head')} ({token.address})  {style(token.mode, token.mode)}"]
    if token.poisoned:
        since = human_time(token.since)
        lines.append("  " + style(f"POISONED since {since}: {token.reason}", "bad"))
        clear = cli_command("poison", "clear", operands=[token.name])
        lines.append(f"  hint: run {clear} once it is checked")
    if token.unaccounted:
        lines.append(
            "  "
            + style(
                f"ON VFIO-PCI WITH NO LEASE: {', '.join(token.unaccounted)}; nothing in the "
                "ledger accounts for it, and nothing acts on it until you decide",
                "bad",
            )
        )
        lines.append(f"  hint: {unaccounted_hint(token.name)}")
    if token.bound_by_admin:
        lines.append("  its home is vfio-pci: bound there on purpose (adopt --admin)")
    lines += _sriov_lines(token, result)
    rows = [("FUNCTION", "DRIVER")]
    rows += [(address, driver or "-") for address, driver in token.drivers]
    lines += _table(rows, style)
    leases = [lease for lease in result.leases if lease.claimant in token.claimants]
    if leases:
        holder_rows = [("HOLDER", "MODE", "STATE", "AGE", "STOPPED FOR IT")]
        for lease in leases:
            state = str(lease.state) + (", transient" if lease.transient else "")
            if lease.claimant in result.stranded:
                state += ", STRANDED"
            stopped = [record.holder for record in lease.stopped if not record.restored]
            holder_rows.append(
                (
                    lease.claimant,
                    str(lease.mode),
                    state,
                    _age(lease, now),
                    ", ".join(stopped) or "-",
                )
            )
        lines += _table(holder_rows, style, bad_column=2)
    lines += _sleep_lines(token, result, leases, style)
    lines += [f"  {_use(holder)}" for holder in token.users]
    return lines


def _sleep_lines(
    token: TokenStatus, result: Status, leases: Sequence[Lease], style: Style
) -> list[str]:
    """Whether the host may suspend while the token is passed through."""
    why = result.sleep.lock_of(token.name)
    if why is not None:
        return [f"  sleep blocked while {why}"]
    if token.name in result.sleep.missing:
        lease = next((x for x in leases if x.sleep_lock_error), None)
        cause = (lease.sleep_lock_error if lease else "") or result.sleep.unavailable
        cause = cause or "its logind inhibitor lock is not held"
        return [
            "  " + style(f"SLEEP NOT BLOCKED while it is passed through: {cause}", "bad"),
            f"  hint: run {cli_command('restore', '--stranded')} to take the lock again "
            'once the host can hold it, or set `sleep = "allow"` to accept it',
        ]
    if result.sleep.policy == "allow" and token.mode == "exclusive":
        return ['  sleep allowed while it is passed through (sleep = "allow")']
    return []


def _sriov_lines(token: TokenStatus, result: Status) -> list[str]:
    """A physical function's VFs (and the tokens on them), a virtual function's PF."""
    by_address = {other.address: other.name for other in result.tokens}
    lines = []
    if token.total_vfs is not None:
        vfs = [
            vf + (f" ({by_address[vf]})" if vf in by_address else "")
            for vf in token.virtual_functions
        ]
        lines.append(
            f"  SR-IOV: {len(vfs)} of {token.total_vfs} VFs"
            + (f": {', '.join(vfs)}" if vfs else "")
        )
    if token.physical_function is not None:
        pf = token.physical_function
        name = f" ({by_address[pf]})" if pf in by_address else ""
        absent = "; it does not exist now" if token.absent else ""
        lines.append(f"  virtual function of {pf}{name}{absent}")
    return lines


# A cell wider than this (a 200-character domain name) does not widen its column:
# it gets a line of its own, and the rest of its row goes on under it, aligned.
MAX_CELL = 40


def width(text: str) -> int:
    """Terminal columns: a wide (CJK) character takes two, a combining mark none."""
    return sum(
        0
        if unicodedata.combining(char)
        else 2
        if unicodedata.east_asian_width(char) in ("W", "F")
        else 1
        for char in text
    )


def _pad(text: str, columns: int) -> str:
    return text + " " * max(columns - width(text), 0)


def _use(holder: Holder) -> str:
    """A holder that runs on the token without a lease, and what that means for claims."""
    if not holder.preemptible:
        what = "not preemptible: exclusive claims are refused"
    elif holder.passthrough:
        what = "it has the GPU passed through; a claim stops it"
    else:
        what = "preemptible: an exclusive claim stops it"
    return f"used by {holder.ref} without a lease ({what})"


def _table(
    rows: Sequence[tuple[str, ...]], style: Style, bad_column: int | None = None
) -> list[str]:
    """Columns padded by display width on the plain text, styled afterwards (ANSI codes
    have no width)."""
    widths = [
        max([width(row[i]) for row in rows if width(row[i]) <= MAX_CELL] or [MAX_CELL])
        for i in range(len(rows[0]))
    ]
    lines = []
    for number, row in enumerate(rows):
        cells: list[str] = []
        for column, cell in enumerate(row):
            last = column == len(row) - 1
            if not last and width(cell) > widths[column]:
                # Too wide: alone on its line; the row goes on under it, in its columns.
                lines.append("  " + "  ".join([*cells, cell]))
                cells = [" " * w for w in widths[: column + 1]]
                continue
            padded = cell if last else _pad(cell, widths[column])
            if number == 0:
                padded = style(padded, "head")
            elif column == bad_column and "STRANDED" in cell:
                padded = style(padded, "bad")
            cells.append(padded)
        lines.append("  " + "  ".join(cells))
    return lines


def _age(lease: Lease, now: datetime) -> str:
    try:
        created = datetime.fromisoformat(lease.created)
    except ValueError:
        return "?"
    return age(now - created)


def _styled(text: str, role: str) -> str:
    return click.style(text, **_COLOURS.get(role, {}))


def _plain(text: str, role: str) -> str:
    return text
