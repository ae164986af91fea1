"""One place that decides where log lines go and how loud they are."""

from __future__ import annotations

import logging
import os
import sys

ENV_DEBUG = "CHARLY_ARBITER_DEBUG"


def log_setup(verbosity: int = 0) -> None:
    """stderr only (stdout belongs to the command's output, and to libvirt in a hook).

    0: warnings, 1 (-v): info, 2 (-vv) or CHARLY_ARBITER_DEBUG=1: debug.
    """
    if os.environ.get(ENV_DEBUG):
        verbosity = 2
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("charly-arbiter: %(levelname)s: %(message)s"))
    root = logging.getLogger("charly_arbiter")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
