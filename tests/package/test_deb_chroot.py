"""The .deb on a clean Debian 12: install with apt, run, remove, purge.

Real throughout: `make deb` builds the package, apt resolves its dependencies
from Debian's archive inside a debootstrap chroot of bookworm (so the program
runs on Debian 12's python3, click, tomlkit, pyudev and libvirt
binding, nothing from PyPI), and the maintainer scripts run as dpkg runs them.
The lease for the purge test is taken by the installed program itself, on a
simulated host (sim:DIR), in the real state directory.
"""

from __future__ import annotations

import json
import os
import stat

import pytest
from pkgtools import Chroot, Deb

pytestmark = [pytest.mark.slow, pytest.mark.package]

HOOK = "/etc/libvirt/hooks/qemu.d/charly-arbiter"
CONFIG = "/etc/charly-arbiter/arbiter.toml"
STATE_DIR = "/var/lib/charly-arbiter"
UNIT = "/lib/systemd/system/charly-arbiter-reconcile.service"
# The resident helper's units, enabled by the package (started where systemd runs).
HELPER = ("/lib/systemd/system/charly-arbiter.socket", "/lib/systemd/system/charly-arbiter.service")
OCI_HOOK = "/usr/libexec/charly-arbiter/oci-hook"
OCI_HOOK_JSON = "/usr/share/containers/oci/hooks.d/charly-arbiter.json"


def _is_executable_regular_file(jail: Chroot, inside: str) -> bool:
    info = os.lstat(jail.path(inside))
    return stat.S_ISREG(info.st_mode) and bool(info.st_mode & stat.S_IXUSR)


def test_installs_with_apt_and_runs_on_debian_libraries(chroot: Chroot, deb: Deb) -> None:
    output = chroot.install(deb).stdout
    assert "restart" in output and "libvirtd" in output, "postinst must say libvirtd must restart"

    version = chroot.run("charly-arbiter", "--version").stdout
    assert deb.version in version
    # Debian's own libraries, not PyPI's: the versions bookworm ships.
    libraries = chroot.run(
        "python3",
        "-c",
        "import click, tomlkit, pyudev, libvirt; "
        "print(click.__version__, tomlkit.__version__, "
        "pyudev.__version__)",
    ).stdout.split()
    assert libraries == ["8.1.3", "0.11.7", "0.24.0"]

    doctor = chroot.run("charly-arbiter", "doctor", "--json", check=False)
    assert "Traceback" not in doctor.stdout and "internal error" not in doctor.stdout, doctor.stdout
    json_text = doctor.stdout[doctor.stdout.index("{") :] if "{" in doctor.stdout else ""
    json.loads(json_text)  # stderr lines come first in the combined output, JSON last

    assert _is_executable_regular_file(chroot, HOOK), f"{HOOK} is not an executable regular file"
    # The OCI hook where Podman and CRI-O find it, pointing at the installed program.
    hooks_d = json.loads(chroot.path(OCI_HOOK_JSON).read_text())
    assert hooks_d["hook"]["path"] == OCI_HOOK and hooks_d["when"] == {"always": True}
    assert _is_executable_regular_file(chroot, OCI_HOOK)
    assert _is_executable_regular_file(chroot, "/usr/libexec/charly-arbiter/oci-runtime")
    # The Proxmox hookscript, as Proxmox runs it for a VM this host has no file of.
    hookscript = "/usr/libexec/charly-arbiter/proxmox-hookscript"
    assert _is_executable_regular_file(chroot, hookscript)
    for phase in ("post-start", "post-stop"):
        answer = chroot.run(hookscript, "100", phase)
        assert (answer.returncode, answer.stdout) == (0, ""), answer
    # As a runtime runs it for a container with no device: its state on stdin, nothing out.
    bundle = chroot.path("/tmp/bundle")
    bundle.mkdir()
    (bundle / "config.json").write_text('{"linux": {"devices": []}}')
    state = '{"id": "plain", "status": "creating", "pid": 1, "bundle": "/tmp/bundle"}'
    oci = chroot.run("/bin/sh", "-c", f"echo '{state}' | {OCI_HOOK}")
    assert oci.stdout == "", oci.stdout
    # As libvirt runs it for a VM with no GPU claim: domain XML on stdin, nothing on stdout.
    domain = "<domain type='kvm'><name>plain</name><devices/></domain>"
    (chroot.path("/tmp/plain.xml")).write_text(domain)
    hook = chroot.run("/bin/sh", "-c", f"{HOOK} plain prepare begin - < /tmp/plain.xml")
    assert hook.stdout == "", hook.stdout
    assert (chroot.path(STATE_DIR).stat().st_mode & 0o777) == 0o700
    conffiles = chroot.path("/var/lib/dpkg/info/charly-arbiter.conffiles").read_text().split()
    assert conffiles == [CONFIG]
    assert (
        chroot.path("/etc/systemd/system/multi-user.target.wants")
        .joinpath("charly-arbiter-reconcile.service")
        .is_symlink()
    ), "the reconcile unit is not enabled"
    metrics_timer = "/etc/systemd/system/timers.target.wants/charly-arbiter-metrics.timer"
    assert not os.path.lexists(chroot.path(metrics_timer)), "the metrics timer is opt-in"
    for wants, unit in (
        ("sockets", "charly-arbiter.socket"),
        ("multi-user", "charly-arbiter.service"),
    ):
        link = chroot.path(f"/etc/systemd/system/{wants}.target.wants/{unit}")
        assert link.is_symlink(), f"the resident helper's {unit} is not enabled"
    # --man=no: the chroot has no man-db (the machine-install test checks the man pages).
    chroot.run("systemd-analyze", "verify", "--man=no", UNIT, *HELPER)
    for path in (
        "/usr/share/man/man8/charly-arbiter.8.gz",
        "/usr/share/man/man8/charly-arbiter-restore.8.gz",
        "/usr/share/bash-completion/completions/charly-arbiter",
        "/usr/share/zsh/vendor-completions/_charly-arbiter",
        "/usr/share/fish/vendor_completions.d/charly-arbiter.fish",
        "/usr/lib/tmpfiles.d/charly-arbiter.conf",
        "/usr/share/charly-arbiter/prometheus/charly-arbiter.rules.yml",
        "/usr/share/charly-arbiter/grafana/charly-arbiter.json",
    ):
        assert chroot.path(path).is_file(), f"{path} is missing"


def test_remove_takes_the_hook_away_and_reinstall_brings_it_back(chroot: Chroot, deb: Deb) -> None:
    chroot.install(deb)
    chroot.apt("remove", "charly-arbiter")
    assert not os.path.lexists(chroot.path(HOOK)), "apt remove left the libvirt hook behind"
    assert chroot.path(CONFIG).is_file(), "apt remove must keep the configuration (a conffile)"
    assert not chroot.path("/usr/bin/charly-arbiter").exists()

    chroot.install(deb)
    assert _is_executable_regular_file(chroot, HOOK), "reinstall did not put the hook back"


def test_purge_keeps_the_ledger_while_a_lease_is_active(chroot: Chroot, deb: Deb) -> None:
    chroot.install(deb)
    chroot.run("charly-arbiter", "sim", "init", "/root/sim")
    claim = ["charly-arbiter", "--config", "/root/sim/arbiter.toml", "--state-dir", STATE_DIR]
    chroot.run(*claim, "acquire", "--exclusive", "libvirt:win11", "gpu0")
    status = chroot.run(*claim, "status", "--json").stdout
    assert [lease["claimant"] for lease in json.loads(status)["leases"]] == ["libvirt:win11"]

    output = chroot.apt("purge", "charly-arbiter").stdout
    assert chroot.path(f"{STATE_DIR}/ledger.toml").is_file(), "purge deleted an active lease"
    assert f"keeping {STATE_DIR}" in output, output
    assert "1 active lease" in output, output
    assert "holds active leases" in output, "prerm must warn that leases stay active"
    assert not os.path.lexists(chroot.path(HOOK))
    assert not chroot.path(CONFIG).exists(), "purge must remove the configuration"
    # ...but the configuration the kept leases refer to stays beside them (issue 9).
    saved = chroot.path(f"{STATE_DIR}/arbiter.toml.saved")
    assert saved.is_file(), "purge kept the leases but lost the configuration they name"
    assert f"kept as {STATE_DIR}/arbiter.toml.saved" in output, output

    # Reinstalled, the program releases the lease; now purge removes the state.
    chroot.install(deb)
    chroot.run(*claim, "release", "--force", "libvirt:win11")
    output = chroot.apt("purge", "charly-arbiter").stdout
    assert not chroot.path(STATE_DIR).exists(), f"purge with no lease kept {STATE_DIR}:\n{output}"
    assert not os.path.lexists(chroot.path(HOOK))
