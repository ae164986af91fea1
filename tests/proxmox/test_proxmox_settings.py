"""`[proxmox]` in arbiter.toml: the defaults are Proxmox's own, and a bad value is
a ConfigError naming the key (the hookscript then refuses the start, saying so)."""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core.config import Config, ProxmoxConfig, load_config
from charly_arbiter.errors import ConfigError
from charly_arbiter.hookio import DEFAULT_STATE
from charly_arbiter.proxmox.hook import DEFAULT_PVE


def load(tmp_path: Path, text: str) -> ProxmoxConfig:
    path = tmp_path / "arbiter.toml"
    path.write_text(text)
    path.chmod(0o644)
    return load_config(path, environ={}).proxmox


def test_the_defaults_are_proxmoxs_own_paths(tmp_path: Path) -> None:
    settings = load(tmp_path, "")
    assert (settings.config_dir, settings.run_dir, settings.lock_dir) == (
        Path("/etc/pve"),
        Path("/run/qemu-server"),
        Path("/var/lock/qemu-server"),
    )
    assert (settings.qm, settings.pct, settings.preemption) == (
        "/usr/sbin/qm",
        "/usr/sbin/pct",
        "stop",
    )
    assert settings.node_name and "." not in settings.node_name
    # The hook's fast path spells the same defaults without importing core/config.
    assert DEFAULT_PVE.decode() == str(settings.config_dir)
    assert DEFAULT_STATE.decode() == str(
        load_config(tmp_path / "arbiter.toml", environ={}).state_dir
    )


def test_every_setting_is_read(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        '[proxmox]\nconfig_dir = "/srv/pve"\nrun_dir = "/srv/run"\nlock_dir = "/srv/lock"\n'
        'qm = "/opt/qm"\npct = "/opt/pct"\nnode = "pve-2"\npreemption = "refuse"\n',
    )
    assert settings == ProxmoxConfig(
        Path("/srv/pve"),
        Path("/srv/run"),
        Path("/srv/lock"),
        "/opt/qm",
        "/opt/pct",
        "pve-2",
        "refuse",
    )
    assert settings.node_name == "pve-2"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('config_dir = "etc/pve"', "proxmox.config_dir"),
        ('qm = "qm"', "proxmox.qm"),
        ("pct = 3", "proxmox.pct"),
        ('node = "-bad"', "proxmox.node"),
        ('node = "a.b"', "proxmox.node"),
        ('preemption = "maybe"', "proxmox.preemption"),
        ('colour = "red"', "proxmox.colour"),
    ],
)
def test_a_bad_setting_names_its_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        load(tmp_path, f"[proxmox]\n{text}\n")
    assert key in str(error.value)


def test_on_a_host_that_is_no_proxmox_node_its_guests_cost_nothing(tmp_path: Path) -> None:
    """Without /etc/pve/qemu-server (or lxc), a claim's holder listing finds no guest
    and imports none of proxmox/ (checked in a fresh interpreter)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from charly_arbiter.compose import holder_sources\n"
        "from charly_arbiter.core.config import Config, ProxmoxConfig\n"
        "from charly_arbiter.errors import HolderError\n"
        f"config = Config(proxmox=ProxmoxConfig(config_dir=Path({str(tmp_path / 'none')!r})))\n"
        "for kind in ('proxmox', 'lxc'):\n"
        "    source = holder_sources()[kind](config)\n"
        "    assert source.holders([]) == [] and not source.is_running(kind + ':100')\n"
        "    try:\n"
        "        source.start(kind + ':100')\n"
        "    except HolderError as error:\n"
        "        assert 'no Proxmox VE node' in str(error)\n"
        "    else:\n"
        "        raise AssertionError('started')\n"
        "print(sorted(m for m in sys.modules if m.startswith('charly_arbiter.proxmox')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    (tmp_path / "pve" / "qemu-server").mkdir(parents=True)
    config = Config(proxmox=ProxmoxConfig(config_dir=tmp_path / "pve"))
    from charly_arbiter.compose import holder_sources
    from charly_arbiter.proxmox.holders import ProxmoxHolders

    assert isinstance(holder_sources("proxmox:100")["proxmox"](config), ProxmoxHolders)


@pytest.mark.parametrize("kind", ["proxmox", "lxc"])
def test_a_proxmox_claimant_is_a_vmid(kind: str) -> None:
    from charly_arbiter.core.model import Claimant
    from charly_arbiter.errors import InvalidClaimant

    for vmid in ("100", "4242", "999999999"):
        assert Claimant.parse(f"{kind}:{vmid}").name == vmid
    for bad in ("99", "1000000000", "0100", "abc", "1e3", "100 ", "\uff11\uff10\uff10", "-100"):
        with pytest.raises(InvalidClaimant, match="VMID from 100 to 999999999"):
            Claimant.parse(f"{kind}:{bad}")
