"""Where events go for a given configuration.

Always the history file in the state directory (what `history`, `explain`
and `metrics` read).  The journal too on a real host, where its socket
exists; a simulated host's events are not the machine's, so they reach a
journal only when `CHARLY_ARBITER_JOURNAL_SOCKET` names one (tests do).
Progress lines on stderr only for an interactive command, never for the
hook, whose stderr libvirt keeps.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

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
    history = HistoryLog(config.state_dir)
    sinks: list[Sink] = [history.append]
    socket_path = journal_socket or _journal_socket(config, environ)
    if socket_path is not None:
        from charly_arbiter.ops.journal import JournalSink  # (socket: only when there is one)

        sinks.append(JournalSink(socket_path))
    if progress:
        from charly_arbiter.ops.progress import Progress

        sinks.append(Progress(sys.stderr))
    return Events(sinks)


def _journal_socket(config: Config, environ: Mapping[str, str]) -> Path | None:
    if environ.get(ENV_JOURNAL_SOCKET):
        return Path(environ[ENV_JOURNAL_SOCKET])
    return JOURNAL_SOCKET if config.host == "local" else None
