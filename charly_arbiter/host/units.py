"""systemd drop-ins that make a service claim its GPUs by itself (`attach`).

`charly-arbiter attach systemd:ollama.service gpu0` writes
`/etc/systemd/system/ollama.service.d/charly-arbiter.conf`:

- `ExecStartPre=+… acquire --shared -- systemd:ollama.service gpu0`: the claim
  is decided before the service starts, and a refusal fails the start with
  the arbiter's reason in the unit's log.  `+` runs it as root whatever the
  unit's `User=` and sandboxing are.
- `ExecStopPost=-+… release --force -- systemd:ollama.service`: systemd runs it
  however the service stopped (a refused start too, which holds no lease);
  `-` keeps a failed release from marking the unit failed.

Arguments are quoted for systemd's command-line syntax (`%` specifiers,
`$VARIABLE` expansion, C escapes: a unit name's `\\x2d` must stay as it is).
The unit directory is a parameter; systemd reads the drop-in at its next
`daemon-reload`, which `attach` asks for when systemd runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from charly_arbiter.core import files
from charly_arbiter.errors import CommandFailed, UsageError, cli_command
from charly_arbiter.host import run

log = logging.getLogger(__name__)

UNIT_DIR = Path("/etc/systemd/system")
SYSTEMD_RUNNING = Path("/run/systemd/system")  # sd_booted(3)'s test
DROPIN = "charly-arbiter.conf"
# systemd's unit name characters (unit_name_is_valid), a service's suffix.
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]{1,247}\.service")
_BARE = re.compile(r"[A-Za-z0-9_./:=@+,-]+")


def check_unit(name: str) -> None:
    if _UNIT.fullmatch(name) is None or name.startswith(".") or "@." in name:
        raise UsageError(
            f"{name!r} is not the name of a service unit",
            hint="attach a service by its full name, such as systemd:ollama.service",
        )


def quote(argument: str) -> str:
    """One argument of an Exec= line, as systemd will split and unescape it."""
    if _BARE.fullmatch(argument):
        return argument
    escaped = argument.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("%", "%%").replace("$", "$$") + '"'


def exec_line(argv: Sequence[str]) -> str:
    return " ".join(quote(argument) for argument in argv)


def dropin_text(
    ref: str, tokens: Sequence[str], acquire: Sequence[str], release: Sequence[str]
) -> str:
    """The drop-in: `acquire` and `release` are whole argvs (program first, absolute)."""
    return "\n".join(
        [
            f"# Written by {cli_command('attach', operands=[ref, *tokens])}; "
            f"{cli_command('detach', operands=[ref])}",
            "# removes it.  The unit claims its GPUs before it starts and releases them however",
            "# it stopped; a refused claim fails the start with the reason in the unit's log.",
            "[Service]",
            f"ExecStartPre=+{exec_line(acquire)}",
            f"ExecStopPost=-+{exec_line(release)}",
            "",
        ]
    )


def dropin_path(unit_dir: Path, unit: str) -> Path:
    check_unit(unit)
    return unit_dir / f"{unit}.d" / DROPIN


def write_file(path: Path, text: str) -> None:
    """Replace `path` in one step (root's, mode 0644: systemd and the config reader
    refuse files others may change)."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.unlink(missing_ok=True)
    files.replace_file(path, text.encode(), temp=temp, mode=0o644)


def remove_file(path: Path) -> bool:
    """Remove it, and its directory when that is left empty (a drop-in's `UNIT.d`)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    with contextlib.suppress(OSError):  # other drop-ins live there
        path.parent.rmdir()
    return True


def daemon_reload() -> str | None:
    """Ask systemd to read its units again; why not, when it cannot be done here."""
    if not SYSTEMD_RUNNING.is_dir():
        return "systemd is not running here"
    systemctl = run.which("systemctl")
    if systemctl is None:
        return "systemctl is not installed"
    try:
        run.run([systemctl, "daemon-reload"], timeout=120)
    except CommandFailed as error:
        return str(error)
    return None
