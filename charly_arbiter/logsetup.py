"""One place that decides where log lines go and how loud they are."""

from __future__ import annotations

import logging
import os
import sys

ENV_DEBUG = "CHARLY_ARBITER_DEBUG"


# Where the system log listens (journald's syslog socket, or a syslog daemon's).
SYSLOG_SOCKETS = ("/run/systemd/journal/dev-log", "/dev/log")


def log_setup(verbosity: int = 0, *, stderr: bool = True) -> None:
    """Log lines to stderr (stdout belongs to the command's output, and to libvirt in
    a hook), or, with `stderr=False`, to the system log: a hook's stderr is what
    libvirt shows the user of a refused start, and must hold only the one or two
    sentences of the refusal; its steps and warnings go to the system log (and to
    `hook_log` when one is configured).

    0: warnings, 1 (-v): info, 2 (-vv) or CHARLY_ARBITER_DEBUG=1: debug.
    """
    if os.environ.get(ENV_DEBUG):
        verbosity = 2
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    handler: logging.Handler
    if stderr:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("charly-arbiter: %(levelname)s: %(message)s"))
    else:
        handler = _system_log() or logging.NullHandler()
    root = logging.getLogger("charly_arbiter")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def _system_log() -> logging.Handler | None:
    from logging.handlers import SysLogHandler

    for socket_path in SYSLOG_SOCKETS:
        if os.path.exists(socket_path):
            try:
                handler = SysLogHandler(address=socket_path)
            except OSError:
                continue
            handler.setFormatter(logging.Formatter("charly-arbiter[%(process)d]: %(message)s"))
            return handler
    return None
