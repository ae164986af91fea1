"""The package as `make install` lays it out, for the guests that run it installed.

chain.py copies parts of the tree into its overlays; sysguest.py copies them onto
the systemd guest's root before systemd starts (`Spec.installed`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}


def install_package(stage: Path, build: Path) -> None:
    """`make install` into `stage`, as a from-source install lays it out (PREFIX=/usr:
    the program, the package, the hook in qemu.d, the example configuration)."""
    result = subprocess.run(
        [
            "/usr/bin/make",
            "-C",
            str(REPO),
            "install",
            f"DESTDIR={stage}",
            "PREFIX=/usr",
            f"BUILDDIR={build}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=CLEAN_ENV,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # compiled, as the Debian package's postinst does (py3compile): the hook's first
    # runs would otherwise compile every module under TCG
    packages = stage / "usr" / "lib" / "python3" / "dist-packages"
    compiled = subprocess.run(
        ["/usr/bin/python3", "-m", "compileall", "-q", str(packages)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
