"""Shared pieces of the package tests: the built .deb, a clean Debian 12 chroot, the lock.

The .deb is built once per session with `make deb` from the checkout (the
same command a user runs).  Each chroot test unpacks a cached debootstrap of
bookworm (minbase plus systemd, for systemd-tmpfiles and systemd-analyze) into
its own directory, so dependencies resolve from Debian's archive with apt,
exactly as on a stock Debian 12 host.  The cache lives in
/var/cache/charly-arbiter-tests and is rebuilt when older than two weeks.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pkgtools import CLEAN_ENV, REPO, VERSION, Chroot, Deb, base_tarball, log, need_root, run


@pytest.fixture(scope="session")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Deb:
    """`make deb` from the checkout, into a temporary build and dist directory."""
    for tool in ("/usr/bin/dpkg-buildpackage", "/usr/bin/dh"):
        if not os.access(tool, os.X_OK):
            pytest.fail(f"{tool} is missing: run scripts/setup (scripts/apt-packages.txt)")
    work = tmp_path_factory.mktemp("deb")
    started = time.monotonic()
    run(
        ["make", "-C", str(REPO), "deb", f"BUILDDIR={work / 'build'}", f"DISTDIR={work / 'dist'}"],
        env=CLEAN_ENV,
    )
    elapsed = time.monotonic() - started
    path = work / "dist" / f"charly-arbiter_{VERSION}_all.deb"
    assert path.is_file(), f"make deb did not produce {path}"
    log(f"built {path.name} in {elapsed:.1f} s")
    return Deb(path, VERSION, elapsed)


@pytest.fixture
def chroot(tmp_path: Path) -> Iterator[Chroot]:
    """A fresh bookworm root with /proc and a read-only /sys, and current apt lists."""
    need_root()
    tarball = base_tarball()
    root = tmp_path / "root"
    root.mkdir()
    run(["tar", "-C", str(root), "--numeric-owner", "-xf", str(tarball)])
    mounted: list[Path] = []
    try:
        for fstype, target, options in (("proc", "proc", "rw"), ("sysfs", "sys", "ro")):
            run(["mount", "-t", fstype, "-o", options, fstype, str(root / target)])
            mounted.append(root / target)
        shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
        jail = Chroot(root)
        jail.apt("update")
        yield jail
    finally:
        for target in reversed(mounted):
            if run(["umount", str(target)], check=False).returncode != 0:
                run(["umount", "-l", str(target)], check=False)
        if not any(os.path.ismount(target) for target in mounted):
            shutil.rmtree(root, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the installed-package libvirt and Podman tests first in a run that includes
    tests/libvirt or tests/oci.

    Their session fixtures hold /tmp/charly-libvirt.lock (and a running libvirtd)
    or /tmp/charly-podman.lock until the very end of the pytest session; the
    installed-package tests need them free (and take the libvirt lock themselves),
    so they must come before: after, they would wait for this very process.
    """
    first = [
        i
        for i in items
        if i.get_closest_marker("package")
        and (i.get_closest_marker("libvirt") or i.get_closest_marker("podman"))
    ]
    items[:] = first + [item for item in items if item not in first]
