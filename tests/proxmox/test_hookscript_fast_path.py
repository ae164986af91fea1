"""The hookscript's path for a VM that names no PCI device stays light: measured
with `python -X importtime` on the real hook process, as Proxmox would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from charly_arbiter.hookio import setting
from charly_arbiter.proxmox.hook import CLAIM_MARKERS, may_claim

REPO = Path(__file__).resolve().parents[2]
LIGHT_FORBIDDEN = (
    "charly_arbiter.core",
    "charly_arbiter.proxmox.hookrun",
    "tomllib",
    "logging",
    "click",
)


def imported(
    tmp_path: Path, vm: str, phase: str, ledger: str | None = None
) -> tuple[int, set[str]]:
    pve = tmp_path / "pve"
    (pve / "qemu-server").mkdir(parents=True, exist_ok=True)
    (pve / "qemu-server" / "100.conf").write_text(vm)
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    if ledger is not None:
        (state / "ledger.toml").write_text(ledger)
    config = tmp_path / "arbiter.toml"
    config.write_text(
        f'host = "sim:{tmp_path / "host"}"\nstate_dir = "{state}"  # the state\n'
        f"\n[proxmox]\nconfig_dir = '{pve}'\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "charly_arbiter",
            "hook",
            "proxmox",
            "100",
            phase,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "CHARLY_ARBITER_CONFIG": str(config),
        },
        timeout=60,
    )
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "charly_arbiter.proxmox.hook" in modules, (
        "no import was measured: the check would be empty"
    )
    return result.returncode, modules


PLAIN = (
    "#web server%3A no GPU\nmemory: 2048\nname: web\n"
    "net0: virtio=BC:24:11:00:00:01,bridge=vmbr0\n\n[snap]\nhostpci0: 0a:00\n"
)


@pytest.mark.parametrize("phase", ["pre-start", "post-start", "post-stop"])
def test_a_vm_without_pci_devices_imports_nothing_heavy(tmp_path: Path, phase: str) -> None:
    code, modules = imported(tmp_path, PLAIN, phase, ledger='claimant = "proxmox:1000"\n')
    assert code == 0
    assert not {m for m in modules if m.startswith(LIGHT_FORBIDDEN)}, sorted(modules)


@pytest.mark.parametrize(
    ("vm", "phase", "ledger"),
    [
        ("hostpci0: 0a:00\n", "pre-start", None),
        ("tags: Charly-Preemptible\n", "pre-start", None),
        (PLAIN, "post-stop", 'claimant = "proxmox:100"\n'),
    ],
    ids=["hostpci", "override-tag", "lease-in-the-ledger"],
)
def test_what_may_concern_the_arbiter_takes_the_slow_path(
    tmp_path: Path, vm: str, phase: str, ledger: str | None
) -> None:
    _, modules = imported(tmp_path, vm, phase, ledger)
    assert "charly_arbiter.proxmox.hookrun" in modules


@pytest.mark.parametrize("leased", [True, False])
def test_post_start_notes_a_leased_vms_start_without_the_slow_path(
    tmp_path: Path, leased: bool
) -> None:
    ledger = 'claimant = "proxmox:100"\n' if leased else 'claimant = "proxmox:1000"\n'
    code, modules = imported(tmp_path, "hostpci0: 0a:00\n", "post-start", ledger)
    assert code == 0
    assert not {m for m in modules if m.startswith(LIGHT_FORBIDDEN)}, sorted(modules)
    assert (tmp_path / "state" / "proxmox-started" / "100").exists() == leased


def test_the_markers_are_the_claim_rules_words() -> None:
    from charly_arbiter.proxmox.hook import STARTED_DIR
    from charly_arbiter.proxmox.hookrun import STARTED_DIR as WATCHED
    from charly_arbiter.proxmox.vmconf import DESCRIPTION_MARKER, TAG_PREFIX

    assert STARTED_DIR.decode() == WATCHED  # spelt twice: the fast path imports neither

    assert set(CLAIM_MARKERS) == {b"hostpci", TAG_PREFIX.encode()}
    assert DESCRIPTION_MARKER.startswith(TAG_PREFIX)
    assert not may_claim(b"name: x\n[PENDING]\nhostpci0: 0a:00\n")
    assert not may_claim(b"[snap]\nhostpci0: 0a:00\n")
    assert may_claim(b"#CHARLY-arbiter%3A tokens=gpu0\n")


@pytest.mark.parametrize(
    ("toml", "value"),
    [
        (b'config_dir = "/srv/pve"\n', b"/srv/pve"),
        (b"  config_dir='/srv/pve' # where\n", b"/srv/pve"),
        (b"# config_dir = '/x'\nother = 1\n", None),
        (b"config_dirs = '/x'\n", None),
    ],
)
def test_settings_read_without_a_toml_parser(toml: bytes, value: bytes | None) -> None:
    assert setting(toml, b"config_dir") == value


@pytest.mark.parametrize(
    "toml",
    [
        b'config_dir = "/a\\tb"\n',
        b"config_dir = '/a'\nconfig_dir = '/b'\n",
        b'config_dir = """/a"""\n',
        b"config_dir = /a\n",
        b'config_dir = "/a" x\n',
        b'config_dir = "/a\n',
    ],
)
def test_settings_it_cannot_read_for_certain_go_to_the_slow_path(toml: bytes) -> None:
    from charly_arbiter.hookio import Unsure

    with pytest.raises(Unsure):
        setting(toml, b"config_dir")
