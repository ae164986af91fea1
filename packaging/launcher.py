#!/usr/bin/python3
"""Write the `charly-arbiter` program itself: a few lines of Python, started without
`site` (`python3 -S`).

libvirt starts this program on every claim, the OCI runtime on every container, and
when the resident helper (`charly-arbiter serve`) runs, all the program does is hand
its command over, which needs the standard library only.  Python's `site` (the .pth
files of every installed distribution, sitecustomize) is a third of the
interpreter's start on Debian 12, so the launcher skips it and puts the one
directory it needs, where the package is installed, on sys.path itself; whatever
runs in-process sets `site` up first (`hookio.python_with_site`).  A launcher whose
directory is wrong still works: without it the package is looked for after `site`.

The launchers pip, installer and dh-python generate import `re` (for a rename of
argv[0] that only Windows needs) and start with `site`, so the package installs its
own.  Usage:

    launcher.py PATH PYTHON PREFIX
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

TEMPLATE = '''\
#!{python} -S
"""charly-arbiter, started without site: packaging/launcher.py says why."""
import sys

sys.path.append({library!r})
try:
    from charly_arbiter.cli import main
except ImportError:
    sys.path.remove({library!r})
    import site

    site.main()
    from charly_arbiter.cli import main
main()
'''


def python_dir(prefix: str) -> str:
    """Where a package installed under PREFIX lives, the way each distribution lays
    out its Python: on Debian /usr/lib/python3/dist-packages for PREFIX=/usr and
    PREFIX/lib/python3.X/dist-packages otherwise; elsewhere the standard
    posix_prefix scheme (PREFIX/lib/python3.X/site-packages)."""
    if "deb_system" in sysconfig.get_scheme_names():  # Debian and its derivatives
        if prefix == "/usr":
            return sysconfig.get_path("purelib", "deb_system", vars={"base": prefix})
        return f"{prefix}/lib/python{sysconfig.get_python_version()}/dist-packages"
    return sysconfig.get_path("purelib", "posix_prefix", vars={"base": prefix})


def write_launcher(path: Path, python: str, library: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TEMPLATE.format(python=python, library=library))
    path.chmod(0o755)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} PATH PYTHON PREFIX")
    write_launcher(Path(sys.argv[1]), sys.argv[2], python_dir(sys.argv[3]))
