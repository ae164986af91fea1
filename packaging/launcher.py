#!/usr/bin/python3
"""Write the `charly-arbiter` program itself: two lines of Python.

The launcher pip, installer and dh-python generate imports `re` (for a rename
of argv[0] that only Windows needs) before anything else; libvirt starts this
program on every claim, so the package installs its own.  Usage:

    launcher.py PATH PYTHON
"""

from __future__ import annotations

import sys
from pathlib import Path


def write_launcher(path: Path, python: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{python}\nfrom charly_arbiter.cli import main\n\nmain()\n")
    path.chmod(0o755)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} PATH PYTHON")
    write_launcher(Path(sys.argv[1]), sys.argv[2])
