"""Events to the systemd journal, with structured fields, over its native socket.

`journalctl CHARLY_TOKEN=gpu0` or `journalctl CHARLY_CLAIMANT=libvirt:win11`
then finds everything about a GPU or a VM.  The native protocol is a datagram
of `KEY=value` lines (a value with a newline is sent as `KEY\\n`, a 64-bit
little-endian length, the bytes and `\\n`), so no python-systemd is needed.
Where there is no journal socket (a container, a test host) nothing is sent.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from charly_arbiter.core.events import ERRORS, WARNINGS, describe

log = logging.getLogger(__name__)

IDENTIFIER = "charly-arbiter"
_NOT_KEY = re.compile(r"[^A-Z0-9_]")
# Priorities as syslog numbers: err, warning, info.
_ERR, _WARNING, _INFO = 3, 4, 6


def journal_fields(kind: str, fields: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The journal entry for an event: MESSAGE, PRIORITY and one CHARLY_* per field."""
    priority = _ERR if kind in ERRORS else _WARNING if kind in WARNINGS else _INFO
    entry = [
        ("MESSAGE", describe(kind, fields)),
        ("PRIORITY", str(priority)),
        ("SYSLOG_IDENTIFIER", IDENTIFIER),
        ("CHARLY_EVENT", kind),
    ]
    for key, value in fields.items():
        entry.append((_key(key), "" if value is None else str(value)))
    return entry


def encode(entry: list[tuple[str, str]]) -> bytes:
    parts = []
    for key, value in entry:
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            parts.append(key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n")
        else:
            parts.append(key.encode() + b"=" + data + b"\n")
    return b"".join(parts)


class JournalSink:
    """An `Events` sink sending each event as one journal entry to `socket_path`."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        if not self.socket_path.exists():
            return
        data = encode(journal_fields(kind, fields))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.sendto(data, os.fspath(self.socket_path))
            except OSError as error:
                # The history file has the event; the journal is a convenience.
                log.debug("could not send event %s to %s: %s", kind, self.socket_path, error)


def _key(name: str) -> str:
    return "CHARLY_" + _NOT_KEY.sub("_", name.upper())
