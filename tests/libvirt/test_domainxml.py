"""Claims read from domain XML: the rules, and what unsafe XML is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core.model import Mode
from charly_arbiter.libvirt.domainxml import (
    MAX_XML_BYTES,
    NAMESPACE,
    DomainXMLError,
    mdev_parent,
    parse_domain,
    resolve_claim,
)
from charly_arbiter.libvirt.hook import CLAIM_MARKERS

OWNER = {"0000:0a:00.0": "gpu0", "0000:0a:00.1": "gpu0", "0000:0b:00.0": "gpu1"}
UUID = "4b20d080-1b54-4048-85b3-a6a62d165c01"


def domain(devices: str = "", metadata: str = "") -> bytes:
    return (
        f"<domain type='kvm'><name>win11</name><metadata>{metadata}</metadata>"
        f"<devices>{devices}</devices></domain>"
    ).encode()


def pci(bus: str, function: str = "0x0", mode: str = "subsystem") -> str:
    return (
        f"<hostdev mode='{mode}' type='pci' managed='yes'><source><address domain='0x0000' "
        f"bus='{bus}' slot='0x00' function='{function}'/></source></hostdev>"
    )


def mdev(uuid: str = UUID) -> str:
    return (
        "<hostdev mode='subsystem' type='mdev' model='vfio-pci'>"
        f"<source><address uuid='{uuid}'/></source></hostdev>"
    )


def element(body: str = "", **attributes: str) -> str:
    attrs = "".join(f' {k}="{v}"' for k, v in attributes.items())
    return f'<ca:claim xmlns:ca="{NAMESPACE}"{attrs}>{body}</ca:claim>'


def claim_of(xml: bytes, parents: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return resolve_claim(parse_domain(xml), OWNER.get, (parents or {}).get)


def test_pci_hostdev_of_a_token_function_is_an_exclusive_claim() -> None:
    claim = claim_of(domain(pci("0x0a", "0x1") + pci("0x0b")))
    assert claim is not None
    assert (claim.mode, claim.tokens) == (Mode.EXCLUSIVE, ("gpu0", "gpu1"))


def test_hostdev_of_no_token_and_no_hostdev_make_no_claim() -> None:
    assert claim_of(domain(pci("0x03"))) is None  # a NIC passed through
    assert claim_of(domain()) is None
    assert claim_of(domain(pci("0x0a", mode="capabilities"))) is None


def test_mdev_whose_parent_is_a_token_gpu_is_a_shared_claim() -> None:
    claim = claim_of(domain(mdev()), {UUID: "0000:0b:00.0"})
    assert claim is not None
    assert (claim.mode, claim.tokens) == (Mode.SHARED, ("gpu1",))
    assert claim_of(domain(mdev()), {}) is None


def test_claim_element_overrides_mode_and_adds_tokens_and_flags() -> None:
    metadata = element(
        "<ca:token>gpu1</ca:token>",
        mode="shared",
        preemptible="yes",
        transient="no",
        stop="destroy",
    )
    claim = claim_of(domain(pci("0x0a"), metadata))
    assert claim is not None
    assert (claim.mode, claim.tokens) == (Mode.SHARED, ("gpu0", "gpu1"))
    assert (claim.preemptible, claim.transient, claim.stop) == (True, False, "destroy")


def test_claim_element_with_tokens_and_no_mode_is_exclusive() -> None:
    claim = claim_of(domain(metadata=element("<ca:token>gpu1</ca:token>")))
    assert claim is not None and claim.mode is Mode.EXCLUSIVE


def test_element_in_another_namespace_is_ignored() -> None:
    other = (
        '<x:claim xmlns:x="https://example.org/claim" mode="shared">'
        "<x:token>gpu0</x:token></x:claim>"
    )
    assert claim_of(domain(metadata=other)) is None


@pytest.mark.parametrize(
    ("xml", "why"),
    [
        (b"<!DOCTYPE domain [<!ENTITY a 'b'>]><domain>&a;</domain>", "DOCTYPE"),
        (b"<domain><name>x</name>" + b" " * MAX_XML_BYTES + b"</domain>", "larger than"),
        (b"<domain><hostdev>", "not well-formed"),
        (b"<network/>", "root element"),
        (domain(pci("0x1ff")), "bad address"),
        (domain(mdev("../../etc")), "not a UUID"),
        (domain(metadata=element(mode="both")), "not exclusive or shared"),
        (domain(metadata=element("<ca:token>../gpu</ca:token>")), "not a token name"),
        (domain(metadata=element(preemptible="maybe")), "not yes or no"),
        (domain(metadata=element(stop="reboot")), "stop"),
    ],
)
def test_unsafe_or_malformed_xml_is_refused_with_the_reason(xml: bytes, why: str) -> None:
    with pytest.raises(DomainXMLError, match=why):
        parse_domain(xml, "vm")


def might_claim(xml: bytes) -> bool:
    """The hook's byte scan (libvirt/hook.py), which clears a domain before any parse."""
    return any(marker in xml for marker in CLAIM_MARKERS)


def test_byte_scan_clears_domains_that_cannot_claim() -> None:
    assert not might_claim(domain())
    assert might_claim(domain(pci("0x0a")))
    assert might_claim(domain(metadata=element()))
    assert not parse_domain(domain(), "vm").mentions_gpus


def test_mdev_parent_is_read_from_sysfs(tmp_path: Path) -> None:
    """A sysfs layout like the kernel's: bus/mdev/devices/UUID links into the parent."""
    device = tmp_path / "devices" / "pci0000:00" / "0000:0b:00.0" / UUID
    device.mkdir(parents=True)
    (tmp_path / "bus" / "mdev" / "devices").mkdir(parents=True)
    (tmp_path / "bus" / "mdev" / "devices" / UUID).symlink_to(device)
    assert mdev_parent(tmp_path, UUID) == "0000:0b:00.0"
    assert mdev_parent(tmp_path, "4b20d080-1b54-4048-85b3-a6a62d165c02") is None
    assert mdev_parent(tmp_path, "../../etc") is None


def test_the_shipped_example_is_a_preemptible_shared_claim() -> None:
    from tests.conftest import REPO

    xml = (REPO / "etc" / "charly-arbiter" / "domain-metadata.xml").read_bytes()
    claim = claim_of(xml)
    assert claim is not None
    assert (claim.mode, claim.tokens, claim.preemptible, claim.stop) == (
        Mode.SHARED,
        ("gpu0",),
        True,
        "managedsave",
    )
