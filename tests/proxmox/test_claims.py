"""A VM's claim from its configuration (proxmox/claims.py), table-driven: which
tokens in which mode for every way a hostpci line names a device, mappings
resolved as qemu-server resolves them on this node, and the override."""

from __future__ import annotations

import pytest

from charly_arbiter.core.host import PciFunction, TokenSpec
from charly_arbiter.core.model import Mode
from charly_arbiter.proxmox.claims import ProxmoxNode, VmClaim, vm_claim
from charly_arbiter.proxmox.mapping import MappingError, Reservation, parse_mappings
from charly_arbiter.proxmox.vmconf import GuestConfigError, parse_vm_config
from tests.proxmox.conftest import config_text


def function(address: str, pci_class: str, device: str, group: int) -> PciFunction:
    return PciFunction(address, "10de", device, pci_class, "nvidia", str(group))


TOKENS = [
    TokenSpec(
        "gpu0",
        "0000:0a:00.0",
        (
            function("0000:0a:00.0", "030000", "2684", 12),
            function("0000:0a:00.1", "040300", "22ba", 12),
        ),
    ),
    TokenSpec("gpu1", "0000:0b:00.0", (function("0000:0b:00.0", "030000", "2204", 13),)),
]


def node(
    reservations: list[tuple[str, Reservation]] | None = None, name: str = "pve1"
) -> ProxmoxNode:
    return ProxmoxNode(
        node=name,
        mappings=lambda: parse_mappings(config_text("pci.cfg")),
        reservations=lambda: reservations or [],
        alive=lambda pid: True,
    )


def claim(text: str, where: ProxmoxNode | None = None, *, running: bool = False) -> VmClaim | None:
    config = parse_vm_config(text.encode(), "proxmox:100")
    return vm_claim("100", config, TOKENS, where or node(), running=running)


@pytest.mark.parametrize(
    ("text", "mode", "tokens"),
    [
        ("name: plain\nmemory: 1024\n", None, None),
        ("hostpci0: 0a:00\n", Mode.EXCLUSIVE, ("gpu0",)),
        ("hostpci0: 0000:0a:00.0\n", Mode.EXCLUSIVE, ("gpu0",)),
        ("hostpci0: 0a:00.1\n", Mode.EXCLUSIVE, ("gpu0",)),  # the audio function claims its GPU
        ("hostpci0: 0a:00.0;0b:00.0\n", Mode.EXCLUSIVE, ("gpu0", "gpu1")),
        ("hostpci0: 0a:00.0\nhostpci5: 0b:00,pcie=1\n", Mode.EXCLUSIVE, ("gpu0", "gpu1")),
        ("hostpci0: 0c:00.0\n", None, None),  # a device of no token (a NIC)
        ("hostpci0: 0001:0a:00.0\n", None, None),  # another domain
        ("hostpci0: 0a:00.0,mdev=nvidia-63\n", Mode.SHARED, ("gpu0",)),
        ("hostpci0: 0a:00,x-vga=1,pcie=1,rombar=0,romfile=gpu.rom\n", Mode.EXCLUSIVE, ("gpu0",)),
        ("#charly-arbiter%3A tokens=gpu1\nname: x\n", Mode.EXCLUSIVE, ("gpu1",)),
        ("#charly-arbiter%3A tokens=gpu1 mode=shared\n", Mode.SHARED, ("gpu1",)),
        ("#charly-arbiter%3A mode=shared\nhostpci0: 0a:00\n", Mode.SHARED, ("gpu0",)),
        ("hostpci0: mapping=audio-only\n", Mode.EXCLUSIVE, ("gpu0",)),
        ("hostpci0: mapping=gpu-pool\n", Mode.EXCLUSIVE, ("gpu0",)),  # the first free entry
        ("hostpci0: mapping=gpu-pool,mdev=nvidia-63\n", Mode.SHARED, ("gpu0", "gpu1")),
        ("hostpci0: 0a:00\n[snap]\nhostpci0: 0b:00\n", Mode.EXCLUSIVE, ("gpu0",)),
    ],
)
def test_the_claim_of_a_configuration(text: str, mode: Mode | None, tokens) -> None:
    found = claim(text)
    if mode is None:
        assert found is None
    else:
        assert found is not None and (found.mode, found.tokens) == (mode, tokens)


def test_the_override_sets_preemptible_transient_and_stop() -> None:
    found = claim(config_text("vm-101-llm-mdev.conf"))
    assert found == VmClaim(
        Mode.SHARED, ("gpu0",), preemptible=True, transient=False, stop="shutdown"
    )
    stop = claim("#charly-arbiter%3A stop=stop transient=yes\nhostpci0: 0b:00\n")
    assert stop is not None and (stop.stop, stop.transient, stop.preemptible) == (
        "stop",
        True,
        False,
    )


def test_mediated_and_whole_devices_in_one_vm_refuse_one_mode_for_both() -> None:
    text = "hostpci0: 0a:00.0,mdev=nvidia-63\nhostpci1: 0b:00\n"
    with pytest.raises(GuestConfigError, match="one mode per VM"):
        claim(text)
    running = claim(text, running=True)  # as a holder: it uses both, exclusively for us
    assert running is not None and (running.mode, running.tokens) == (
        Mode.EXCLUSIVE,
        ("gpu1", "gpu0"),
    )


def test_a_mapping_entry_another_running_vm_reserved_is_passed_over() -> None:
    reserved = [("0000:0a:00.0", Reservation("200", pid=42))]
    found = claim("hostpci0: mapping=gpu-pool\n", node(reserved))
    assert found is not None and found.tokens == ("gpu1",)
    both = [*reserved, ("0000:0b:00.0", Reservation("201", until=2**40))]
    with pytest.raises(MappingError, match=r"in use \(by VM 200, 201\)"):
        claim("hostpci0: mapping=gpu-pool\n", node(both))


def test_a_line_before_takes_its_device_out_of_the_pool() -> None:
    found = claim("hostpci0: 0a:00.0\nhostpci1: mapping=gpu-pool\n")
    assert found is not None and found.tokens == ("gpu0", "gpu1")
    with pytest.raises(GuestConfigError, match="assigned more than once"):
        claim("hostpci0: mapping=gpu-pool\nhostpci1: 0a:00.0\n")


def test_a_running_vm_holds_the_entry_reserved_for_it() -> None:
    mine = [("0000:0b:00.0", Reservation("100", pid=7))]
    found = claim("hostpci0: mapping=gpu-pool\n", node(mine), running=True)
    assert found is not None and found.tokens == ("gpu1",)
    unknown = claim("hostpci0: mapping=gpu-pool\n", node([]), running=True)
    assert unknown is not None and unknown.tokens == ("gpu0", "gpu1")  # cannot tell: both


@pytest.mark.parametrize(
    ("text", "where", "why"),
    [
        ("hostpci0: mapping=nope\n", node(), "no such PCI mapping"),
        ("hostpci0: mapping=gpu-pool\n", node(name="pve3"), "no device on node 'pve3'"),
    ],
)
def test_a_mapping_that_cannot_be_resolved_refuses(text: str, where: ProxmoxNode, why: str) -> None:
    with pytest.raises(MappingError, match=why) as error:
        claim(text, where)
    assert "proxmox:100" in str(error.value) and error.value.hint


def test_a_mapping_that_no_longer_matches_the_hardware_refuses() -> None:
    """qemu-server's assert_valid: the vendor:device and the first IOMMU group."""
    changed = config_text("pci.cfg").replace(
        "id=10de:2684,iommugroup=12", "id=10de:2704,iommugroup=12"
    )
    where = ProxmoxNode("pve1", lambda: parse_mappings(changed), lambda: [], lambda pid: True)
    with pytest.raises(MappingError, match="10de:2684 now, the mapping says 10de:2704"):
        claim("hostpci0: mapping=gpu-pool\n", where)
    moved = config_text("pci.cfg").replace("iommugroup=12", "iommugroup=40")
    where = ProxmoxNode("pve1", lambda: parse_mappings(moved), lambda: [], lambda pid: True)
    with pytest.raises(MappingError, match="IOMMU group 12 now, the mapping says 40"):
        claim("hostpci0: mapping=gpu-pool\n", where)
