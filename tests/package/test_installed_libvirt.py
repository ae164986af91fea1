"""The libvirt end-to-end scenarios against the INSTALLED package, on this machine.

`apt install ./charly-arbiter_*.deb` on the machine itself (its dependencies
are Debian's packages: system python3, click, tomlkit, pyudev,
python3-libvirt), then tests/libvirt (INSTALLED_SUITE) runs with CHARLY_ARBITER_E2E_INSTALLED=1:
a real libvirtd, started after the install (libvirt reads hooks only at
start), runs the hook the package installed, which runs /usr/bin/charly-arbiter.
The suite runs under /usr/bin/python3 with -P, so nothing is imported from
the checkout.  Then `apt purge` takes everything away again.

The whole test holds /tmp/charly-libvirt.lock (libvirtd, /etc/libvirt and the
installed package are shared with the libvirt tests); the nested suite is told
so with CHARLY_LIBVIRT_LOCK_HELD=1 and does not take it again.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from pkgtools import (
    CLEAN_ENV,
    REPO,
    Deb,
    installed_on_this_machine,
    need_root,
    run,
    run_installed_suite,
)

pytestmark = [pytest.mark.slow, pytest.mark.package, pytest.mark.libvirt]

HOOK = Path("/etc/libvirt/hooks/qemu.d/charly-arbiter")
UNIT = "/lib/systemd/system/charly-arbiter-reconcile.service"
SUITE_TIMEOUT = 1200
# What the installed package must pass: every scenario of the hook on a real libvirtd
# (the hook, the launcher, Debian's python3 and libraries are what is under test).
# The restart race and `plan libvirt:NAME` run the same installed code through the
# same hook, over minutes; they run against the checkout in tests/libvirt.
INSTALLED_SUITE = (
    "tests/libvirt/test_e2e.py",
    "tests/libvirt/test_hook_fast_path.py",
    "tests/libvirt/test_hook_contract.py",
    "tests/libvirt/test_libvirt_holders.py",
    "tests/libvirt/test_unit_and_container_holders.py",
    "tests/libvirt/test_domainxml.py",
)


def test_libvirt_scenarios_pass_against_the_installed_package(deb: Deb, tmp_path: Path) -> None:
    need_root()
    if not (REPO / "tests" / "libvirt").is_dir():
        pytest.fail("tests/libvirt is missing: nothing to run against the installed package")
    with installed_on_this_machine(deb.path) as output:
        assert "restart" in output.stdout, "postinst must say libvirtd must restart"
        info = os.lstat(HOOK)
        assert stat.S_ISREG(info.st_mode) and info.st_mode & 0o111, f"{HOOK} not executable"
        # The man pages are installed here, so systemd-analyze checks Documentation= too.
        run(["systemd-analyze", "verify", UNIT], env=CLEAN_ENV)
        where = run(
            [
                "/usr/bin/python3",
                "-P",
                "-c",
                "import charly_arbiter; print(charly_arbiter.__file__)",
            ],
            cwd=REPO,
            env=CLEAN_ENV,
        ).stdout.strip()
        assert where.startswith("/usr/lib/python3/dist-packages/"), where
        # The nested suite would take the lock this run holds: it is told it is held.
        run_installed_suite(
            tmp_path, "tests/libvirt", INSTALLED_SUITE, SUITE_TIMEOUT, CHARLY_LIBVIRT_LOCK_HELD="1"
        )
    assert not os.path.lexists(HOOK), "apt purge left the libvirt hook behind"
