"""The Podman scenarios against the INSTALLED package, on this machine.

`apt install ./charly-arbiter_*.deb` on the machine itself, then
tests/oci runs with CHARLY_ARBITER_E2E_INSTALLED=1: real Podman runs the
hook the package put in /usr/share/containers/oci/hooks.d, which runs
/usr/libexec/charly-arbiter/oci-hook, which runs /usr/bin/charly-arbiter on
Debian's python3 and libraries.  The suite runs under /usr/bin/python3 with
-P, so nothing is imported from the checkout.  Then `apt purge` takes
everything away again, the hooks.d file included.

The install holds /tmp/charly-libvirt.lock, as the libvirt run does (the
installed package is shared); the nested suite takes the Podman lock itself.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from pkgtools import CLEAN_ENV, LIBVIRT_LOCK, REPO, Deb, flocked, log, need_root, run

pytestmark = [pytest.mark.slow, pytest.mark.package, pytest.mark.podman]

HOOK_JSON = Path("/usr/share/containers/oci/hooks.d/charly-arbiter.json")
SUITE_TIMEOUT = 900


def _installed() -> bool:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", "charly-arbiter"],
        capture_output=True,
        text=True,
        check=False,
    )
    return "ok installed" in result.stdout or "config-files" in result.stdout


def test_podman_scenarios_pass_against_the_installed_package(deb: Deb, tmp_path: Path) -> None:
    need_root()
    if not os.access("/usr/bin/podman", os.X_OK):
        pytest.fail("podman is not installed: run scripts/setup (scripts/apt-packages.txt)")
    with flocked(LIBVIRT_LOCK):
        if _installed():
            pytest.fail(
                "charly-arbiter is already installed here: `apt purge charly-arbiter` first"
            )
        apt = ["apt-get", "-y", "-q", "-o", "Dpkg::Use-Pty=0"]
        run([*apt, "install", "--no-install-recommends", str(deb.path)], env=CLEAN_ENV)
        try:
            assert HOOK_JSON.is_file(), f"the package did not install {HOOK_JSON}"
            (tmp_path / "path").mkdir()
            (tmp_path / "path" / "tests").symlink_to(REPO / "tests")
            env = {k: v for k, v in os.environ.items() if not k.startswith(("CHARLY_", "PYTHON"))}
            env.update(
                PYTHONPATH=str(tmp_path / "path"),
                CHARLY_ARBITER_E2E_INSTALLED="1",
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
                    "tests/oci/test_oci_hook.py",
                    "tests/oci/test_drains.py",
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=SUITE_TIMEOUT,
                check=False,
            )
            took = time.monotonic() - started
            log(f"tests/oci against the installed package: {took:.0f} s")
            log(suite.stdout[-6000:])
            summary = suite.stdout.strip().splitlines()[-1] if suite.stdout.strip() else ""
            assert suite.returncode == 0, suite.stdout[-12000:]
            assert "passed" in summary and "skipped" not in summary, summary
        finally:
            purge = run([*apt, "purge", "charly-arbiter"], env=CLEAN_ENV, check=False)
            assert purge.returncode == 0, purge.stdout
            assert not HOOK_JSON.exists(), "apt purge left the OCI hook behind"
