"""A Proxmox VM starts through the hookscript, stops what holds its GPU, and gives
everything back on stop (conftest.py says what is real here and what stands in)."""

from __future__ import annotations

import pytest
from conftest import Node, config_text

pytestmark = pytest.mark.slow

WIN11 = "proxmox:100"
JELLYFIN = "lxc:200"


def test_a_vm_stops_a_container_holding_its_gpu_and_gives_everything_back(node: Node) -> None:
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_ct(200, config_text("ct-200-jellyfin.conf"))
    node.pct("start", "200")
    node.check("before", {JELLYFIN: True})

    node.qm("start", "100")
    assert node.running("proxmox", 100) and not node.running("lxc", 200)
    lease = node.leases()[WIN11]
    assert (lease.mode, lease.tokens, [r.holder for r in lease.stopped]) == (
        "exclusive",
        ("gpu0",),
        [JELLYFIN],
    )
    assert set(node.drivers()[a] for a in ("0000:0a:00.0", "0000:0a:00.1")) == {"vfio-pci"}
    # qemu-server's own PCI preparation came after pre-start and found nothing to bind.
    assert any("finds 0000:0a:00.0 on vfio-pci already" in line for line in node.standin_log())
    assert not any("qemu-server binds" in line for line in node.standin_log())
    node.check("running", {JELLYFIN: True})

    node.qm("shutdown", "100")
    node.wait_for("the container back", lambda: node.running("lxc", 200))
    node.settle()
    assert node.leases() == {}
    assert node.drivers()["0000:0a:00.0"] == "nvidia"
    assert node.drivers()["0000:0a:00.1"] == "snd_hda_intel"
    node.check("after", {JELLYFIN: True})
