"""Where events go for a given configuration.

Always the history file in the state directory (what `history`, `explain`
and `metrics` read).  The journal too on a real host, where its socket
exists; a simulated host's events are not the machine's, so they reach a
journal only when `CHARLY_ARBITER_JOURNAL_SOCKET` names one (tests do).
Progress lines on stderr only for an interactive command, never for the
hook, whose stderr libvirt keeps.  An event the history cannot take (a full or
read-only state directory) is a warning in a sentence that names the file and
the fix; it never fails the step it records.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from charly_arbiter.core import files
from charly_arbiter.core.config import Config
from charly_arbiter.core.events import Events, Sink
from charly_arbiter.ops.history import HistoryLog

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
ENV_JOURNAL_SOCKET = "CHARLY_ARBITER_JOURNAL_SOCKET"


def events_for(
    config: Config,
    *,
    progress: bool = False,
    journal_socket: Path | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Events:
    sinks: list[Sink] = [_history_sink(HistoryLog(config.state_dir))]
    socket_path = journal_socket or _journal_socket(config, environ)
    if socket_path is not None:
        from charly_arbiter.ops.journal import JournalSink  # (socket: only when there is one)

        sinks.append(JournalSink(socket_path))
    if progress:
        from charly_arbiter.ops.progress import Progress

        sinks.append(Progress(sys.stderr))
    return Events(sinks)


def _history_sink(history: HistoryLog) -> Sink:
    def append(kind: str, fields: dict[str, Any]) -> None:
        try:
            history.append(kind, fields)
        except OSError as error:
            path = Path(error.filename or history.path)
            raise files.state_dir_error(path, error, "record the event in") from error

    return append


def _journal_socket(config: Config, environ: Mapping[str, str]) -> Path | None:
    if environ.get(ENV_JOURNAL_SOCKET):
        return Path(environ[ENV_JOURNAL_SOCKET])
    return JOURNAL_SOCKET if config.host == "local" else None
