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
from pathlib import Path

import pytest
from pkgtools import Deb, installed_on_this_machine, need_root, run_installed_suite

pytestmark = [pytest.mark.slow, pytest.mark.package, pytest.mark.podman]

HOOK_JSON = Path("/usr/share/containers/oci/hooks.d/charly-arbiter.json")
SUITE_TIMEOUT = 900


def test_podman_scenarios_pass_against_the_installed_package(deb: Deb, tmp_path: Path) -> None:
    need_root()
    if not os.access("/usr/bin/podman", os.X_OK):
        pytest.fail("podman is not installed: run scripts/setup (scripts/apt-packages.txt)")
    with installed_on_this_machine(deb.path):
        assert HOOK_JSON.is_file(), f"the package did not install {HOOK_JSON}"
        run_installed_suite(
            tmp_path,
            "tests/oci",
            ("tests/oci/test_oci_hook.py", "tests/oci/test_drains.py"),
            SUITE_TIMEOUT,
        )
    assert not HOOK_JSON.exists(), "apt purge left the OCI hook behind"
