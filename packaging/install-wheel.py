#!/usr/bin/python3
"""Install the wheel under DESTDIR with PREFIX, into a directory this python3 searches.

`python3 -m installer --prefix` follows the interpreter's default scheme, and
Debian's (posix_local) adds its own `/local`: PREFIX=/usr/local would land in
/usr/local/local/lib/....  So the target directory is chosen here, the way each
distribution lays out its Python (launcher.python_dir, where the program looks for
the package).  Usage:

    install-wheel.py WHEEL DESTDIR PREFIX BINDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from installer import install
from installer.destinations import SchemeDictionaryDestination
from installer.sources import WheelFile
from launcher import python_dir


def main(wheel: str, destdir: str, prefix: str, bindir: str) -> None:
    library = python_dir(prefix)
    scheme = {
        "purelib": library,
        "platlib": library,
        "scripts": bindir,
        "data": prefix,
        "headers": f"{prefix}/include/charly-arbiter",
    }
    destination = SchemeDictionaryDestination(
        scheme, sys.executable, "posix", destdir=destdir or None
    )
    with WheelFile.open(Path(wheel)) as source:
        install(source, destination, {"INSTALLER": b"charly-arbiter Makefile"})
    print(f"installed {wheel} into {destdir}{library}, the program into {destdir}{bindir}")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(f"usage: {sys.argv[0]} WHEEL DESTDIR PREFIX BINDIR")
    main(*sys.argv[1:])
