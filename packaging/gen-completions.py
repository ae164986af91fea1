#!/usr/bin/python3
"""Write bash, zsh and fish completion scripts from click's own completion support.

The scripts are thin: at each <Tab> the shell runs `charly-arbiter` with
_CHARLY_ARBITER_COMPLETE set, and click answers from the live command tree, so
completion never drifts from the program.  Usage:

    PYTHONPATH=. python3 packaging/gen-completions.py OUTDIR

writes OUTDIR/charly-arbiter.bash, OUTDIR/_charly-arbiter (zsh) and
OUTDIR/charly-arbiter.fish.
"""

from __future__ import annotations

import sys
from pathlib import Path

from click.shell_completion import get_completion_class

from charly_arbiter.cli import COMMANDS
from charly_arbiter.cli.app import build

PROGRAM = "charly-arbiter"
COMPLETE_VAR = "_CHARLY_ARBITER_COMPLETE"  # what click derives from the program name
FILES = {"bash": f"{PROGRAM}.bash", "zsh": f"_{PROGRAM}", "fish": f"{PROGRAM}.fish"}


def generate(outdir: Path) -> list[Path]:
    cli = build(COMMANDS)
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for shell, filename in FILES.items():
        completion_class = get_completion_class(shell)
        if completion_class is None:
            sys.exit(f"click has no {shell} completion support")
        source = completion_class(cli, {}, PROGRAM, COMPLETE_VAR).source()
        target = outdir / filename
        target.write_text(source.rstrip("\n") + "\n", encoding="utf-8")
        written.append(target)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUTDIR")
    for script in generate(Path(sys.argv[1])):
        print(script)
