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
import subprocess
import time
from pathlib import Path

import pytest
from pkgtools import CLEAN_ENV, LIBVIRT_LOCK, REPO, Deb, flocked, log, need_root, run

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


def _installed() -> bool:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", "charly-arbiter"],
        capture_output=True,
        text=True,
        check=False,
    )
    return "ok installed" in result.stdout or "config-files" in result.stdout


def test_libvirt_scenarios_pass_against_the_installed_package(deb: Deb, tmp_path: Path) -> None:
    need_root()
    if not (REPO / "tests" / "libvirt").is_dir():
        pytest.fail("tests/libvirt is missing: nothing to run against the installed package")
    with flocked(LIBVIRT_LOCK):
        if _installed():
            pytest.fail(
                "charly-arbiter is already installed here: `apt purge charly-arbiter` first"
            )
        apt = ["apt-get", "-y", "-q", "-o", "Dpkg::Use-Pty=0"]
        output = run([*apt, "install", "--no-install-recommends", str(deb.path)], env=CLEAN_ENV)
        try:
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

            # The tests import `tests.libvirt.conftest`: offer the checkout's tests/ alone
            # on the path, never its charly_arbiter/.
            (tmp_path / "path").mkdir()
            (tmp_path / "path" / "tests").symlink_to(REPO / "tests")
            env = {k: v for k, v in os.environ.items() if not k.startswith(("CHARLY_", "PYTHON"))}
            env.update(
                PYTHONPATH=str(tmp_path / "path"),
                CHARLY_ARBITER_E2E_INSTALLED="1",
                CHARLY_LIBVIRT_LOCK_HELD="1",
                PYTHONSAFEPATH="1",
                PATH=CLEAN_ENV["PATH"],
            )
            started = time.monotonic()
            suite = subprocess.run(
                [
                    "/usr/bin/python3",
                    "-P",
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-rs",
                    *INSTALLED_SUITE,
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=SUITE_TIMEOUT,
                check=False,
            )
            log(f"tests/libvirt against the installed package: {time.monotonic() - started:.0f} s")
            log(suite.stdout[-6000:])
            summary = suite.stdout.strip().splitlines()[-1] if suite.stdout.strip() else ""
            assert suite.returncode == 0, suite.stdout[-12000:]
            assert "passed" in summary and "skipped" not in summary, summary
        finally:
            purge = run([*apt, "purge", "charly-arbiter"], env=CLEAN_ENV, check=False)
            assert purge.returncode == 0, purge.stdout
            assert not os.path.lexists(HOOK), "apt purge left the libvirt hook behind"
