"""Containers as holders (proxmox/holders.py LxcHolders), each way a configuration
gives a container a GPU's nodes, on real character devices under a /dev of the
test's own (a major no driver has here); `pct` is not called for a container
whose file says it holds nothing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from charly_arbiter.core.config import Config, ProxmoxConfig
from charly_arbiter.core.host import UNKNOWN_FUNCTION, PciFunction, TokenSpec
from charly_arbiter.proxmox.holders import DeviceNodes, LxcHolders
from tests.proxmox.conftest import free_major

GPU0, GPU1 = "0000:0a:00.0", "0000:0b:00.0"
TOKENS = [
    TokenSpec("gpu0", GPU0, (PciFunction(GPU0, "10de", "2684", "030000", "nvidia", "12"),)),
    TokenSpec("gpu1", GPU1, (PciFunction(GPU1, "10de", "2204", "030000", "nvidia", "13"),)),
]


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, int, LxcHolders]:
    major = free_major()
    dev = tmp_path / "dev"
    (dev / "dri").mkdir(parents=True)
    numbers = {}
    for name, minor, address in (
        ("card0", 0, GPU0),
        ("renderD128", 128, GPU0),
        ("card1", 1, GPU1),
        ("renderD129", 129, GPU1),
        ("card9", 9, UNKNOWN_FUNCTION),  # a GPU node whose function is not on its driver
    ):
        os.mknod(dev / "dri" / name, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
        numbers[(major, minor)] = address
    (dev / "dri" / "by-path").mkdir()
    (dev / "dri" / "by-path" / "pci-0000:0a:00.0-render").symlink_to("../renderD128")
    pve = tmp_path / "pve"
    (pve / "lxc").mkdir(parents=True)
    config = Config(
        state_dir=tmp_path / "state",
        proxmox=ProxmoxConfig(config_dir=pve, pct="/nonexistent/pct"),
    )
    nodes = DeviceNodes(dev, lambda wanted: {n: numbers[n] for n in wanted if n in numbers})
    return pve, major, LxcHolders(config, nodes)


def held(setup: tuple[Path, int, LxcHolders], text: str) -> dict[str, tuple[str, ...]]:
    pve, major, source = setup
    (pve / "lxc" / "200.conf").write_text(text.replace("226:", f"{major}:"))
    return {str(h.ref): h.tokens for h in source.holders(TOKENS)}


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("dev0: /dev/dri/renderD128,gid=104\n", ("gpu0",)),
        ("dev0: /dev/dri/by-path/pci-0000:0a:00.0-render\n", ("gpu0",)),
        ("dev0: /dev/dri/card1\ndev1: /dev/dri/renderD128\n", ("gpu1", "gpu0")),
        ("lxc.mount.entry: /dev/dri dev/dri none bind,optional,create=dir\n", ("gpu0", "gpu1")),
        (
            "lxc.mount.entry: /dev/dri/renderD129 dev/dri/renderD129 none bind,create=file\n",
            ("gpu1",),
        ),
        ("lxc.cgroup2.devices.allow: c 226:129 rwm\n", ("gpu1",)),
        ("lxc.cgroup2.devices.allow: c 226:* rwm\n", ("gpu0", "gpu1")),
        ("lxc.cgroup.devices.allow: c 226:0 rw\n", ("gpu0",)),
        ("#charly-arbiter%3A tokens=gpu1\n", ("gpu1",)),
    ],
)
def test_each_way_a_container_is_given_a_gpu(setup, text: str, tokens: tuple[str, ...]) -> None:
    assert sorted(held(setup, text)["lxc:200"]) == sorted(tokens)


@pytest.mark.parametrize(
    "text",
    [
        "arch: amd64\nhostname: web\n",
        "lxc.cgroup2.devices.allow: a\nlxc.cgroup2.devices.allow: c *:* rwm\n",
        "lxc.cgroup2.devices.allow: c 226:9 rwm\n",  # a node of no function now
        "dev0: /dev/dri/renderD200\n",  # no such node
        "dev0: /dev/../dev/dri/card0\n",
        "lxc.mount.entry: /srv/dri dev/dri none bind\n",
        "[snap]\ndev0: /dev/dri/card0\n",
    ],
)
def test_what_gives_no_gpu(setup, text: str) -> None:
    assert held(setup, text) == {}


def test_preemptible_only_by_its_override_and_never_asked_about_when_holding_nothing(setup) -> None:
    pve, _, source = setup
    (pve / "lxc" / "201.conf").write_text("hostname: idle\n")
    (pve / "lxc" / "200.conf").write_text("dev0: /dev/dri/card0\ntags: charly-preemptible\n")
    (pve / "lxc" / "202.conf").write_text("dev0: /dev/dri/card1\n")
    (pve / "lxc" / "notes.txt").write_text("not a container")
    found = {str(h.ref): h for h in source.holders(TOKENS)}
    assert sorted(found) == ["lxc:200", "lxc:202"]
    assert found["lxc:200"].preemptible and not found["lxc:202"].preemptible
    assert (
        found["lxc:202"].made_preemptible
        and "charly-preemptible" in found["lxc:202"].made_preemptible
    )
    # `pct status` could not run (/nonexistent/pct): such a container counts as running.
    assert found["lxc:200"].running
