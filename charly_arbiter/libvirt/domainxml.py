"""What a libvirt domain's XML says about GPUs, read safely.

The XML is untrusted (the hook reads it from libvirt's stdin; anyone allowed
to define a domain wrote it), so it is bounded in size and parsed with the
standard library's expat after refusing any DOCTYPE: with no DTD there are
no entities, so no billion-laughs and no external fetches.

Rules (docs/libvirt.md):
- `<hostdev mode='subsystem' type='pci'>` with a source address: an exclusive
  claim on the token that owns that function.
- `<hostdev mode='subsystem' type='mdev'>`: a shared claim on the token whose
  GPU is the mediated device's parent (looked up in sysfs by its UUID).
- `<ca:claim xmlns:ca="https://charly-arbiter.org/xmlns/claim/1">` in
  `<metadata>` overrides or adds mode, tokens, preemptible, transient and stop.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.core.model import Mode
from charly_arbiter.core.pci import from_libvirt, is_address
from charly_arbiter.errors import ArbiterError, InvalidAddress

NAMESPACE = "https://charly-arbiter.org/xmlns/claim/1"
MAX_XML_BYTES = 16 << 20  # a real domain's XML is a few KiB; libvirt's own limit is 10 MiB
STOP_METHODS = ("shutdown", "managedsave", "destroy")

_CLAIM_TAG = f"{{{NAMESPACE}}}claim"
_TOKEN_TAG = f"{{{NAMESPACE}}}token"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_TOKEN_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_DTD = re.compile(rb"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)
_TRUE = ("yes", "true", "1")
_FALSE = ("no", "false", "0")


class DomainXMLError(ArbiterError):
    """The domain XML is too large, not XML, or carries a DTD or a bad claim element."""

    def __init__(self, domain: str, why: str) -> None:
        super().__init__(
            f"the XML of domain {domain!r} was not accepted: {why}",
            hint="fix the domain with `virsh edit` (see docs/libvirt.md for the claim element)",
        )
        self.why = why


@dataclass(frozen=True)
class DomainFacts:
    """What the XML says, before PCI addresses are mapped to tokens."""

    name: str
    pci_addresses: tuple[str, ...] = ()  # <hostdev type='pci'> sources
    mdev_uuids: tuple[str, ...] = ()  # <hostdev type='mdev'> sources
    mode: Mode | None = None  # from the claim element
    tokens: tuple[str, ...] = ()  # from the claim element
    preemptible: bool | None = None
    transient: bool | None = None
    stop: str | None = None  # how to stop it as a holder
    has_claim_element: bool = False

    @property
    def mentions_gpus(self) -> bool:
        """False when nothing in the XML can make a claim: the hook's fast path."""
        return bool(self.pci_addresses or self.mdev_uuids or self.has_claim_element)


@dataclass(frozen=True)
class DomainClaim:
    """The claim a domain makes when it starts."""

    mode: Mode
    tokens: tuple[str, ...]
    preemptible: bool = False
    transient: bool = False
    stop: str | None = None


def parse_domain(xml: bytes, domain: str = "?") -> DomainFacts:
    """Parse a domain XML document; raises `DomainXMLError` for anything unsafe or malformed."""
    if len(xml) > MAX_XML_BYTES:
        raise DomainXMLError(domain, f"it is larger than {MAX_XML_BYTES} bytes")
    if _DTD.search(xml):
        raise DomainXMLError(domain, "it contains a DOCTYPE or ENTITY declaration")
    try:
        root = ET.fromstring(xml)  # noqa: S314 - no DTD (checked above), bounded size
    except ET.ParseError as error:
        raise DomainXMLError(domain, f"it is not well-formed XML ({error})") from None
    if root.tag != "domain":
        raise DomainXMLError(domain, f"the root element is <{root.tag}>, not <domain>")
    name = (root.findtext("name") or domain).strip()
    pci: list[str] = []
    mdev: list[str] = []
    for hostdev in root.iterfind("devices/hostdev"):
        if hostdev.get("mode", "subsystem") != "subsystem":
            continue
        kind = hostdev.get("type")
        address = hostdev.find("source/address")
        if address is None:
            continue
        if kind == "pci":
            pci.append(_pci_address(address, name))
        elif kind == "mdev":
            uuid = (address.get("uuid") or "").lower()
            if _UUID.fullmatch(uuid) is None:
                raise DomainXMLError(name, f"mdev uuid {uuid!r} is not a UUID")
            mdev.append(uuid)
    facts = DomainFacts(name, tuple(dict.fromkeys(pci)), tuple(dict.fromkeys(mdev)))
    claim = root.find(f"metadata/{_CLAIM_TAG}")
    return _with_claim_element(facts, claim) if claim is not None else facts


def _pci_address(element: ET.Element, domain: str) -> str:
    try:
        return from_libvirt(
            element.get("domain", "0x0000"),
            element.get("bus", ""),
            element.get("slot", ""),
            element.get("function", "0x0"),
        )
    except InvalidAddress as error:
        raise DomainXMLError(domain, f"a PCI hostdev has a bad address: {error}") from None


def _with_claim_element(facts: DomainFacts, claim: ET.Element) -> DomainFacts:
    name = facts.name
    mode_text = claim.get("mode")
    mode = None
    if mode_text is not None:
        if mode_text not in (Mode.EXCLUSIVE, Mode.SHARED):
            raise DomainXMLError(name, f"claim mode {mode_text!r} is not exclusive or shared")
        mode = Mode(mode_text)
    tokens = []
    # `virsh metadata --set` puts only the root element in the namespace: accept
    # un-namespaced <token> children of our element too.
    for element in [*claim.iterfind(_TOKEN_TAG), *claim.iterfind("token")]:
        token = (element.text or "").strip()
        if _TOKEN_NAME.fullmatch(token) is None:
            raise DomainXMLError(name, f"claim token {token!r} is not a token name")
        tokens.append(token)
    stop = claim.get("stop")
    if stop is not None and stop not in STOP_METHODS:
        raise DomainXMLError(name, f"claim stop {stop!r} is not one of {', '.join(STOP_METHODS)}")
    return DomainFacts(
        name=facts.name,
        pci_addresses=facts.pci_addresses,
        mdev_uuids=facts.mdev_uuids,
        mode=mode,
        tokens=tuple(dict.fromkeys(tokens)),
        preemptible=_flag(claim, "preemptible", name),
        transient=_flag(claim, "transient", name),
        stop=stop,
        has_claim_element=True,
    )


def _flag(element: ET.Element, attribute: str, domain: str) -> bool | None:
    value = element.get(attribute)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise DomainXMLError(domain, f"claim {attribute}={value!r} is not yes or no")


def mdev_parent(sysfs_root: Path, uuid: str) -> str | None:
    """The PCI address of a mediated device's parent, from `bus/mdev/devices/UUID`."""
    if _UUID.fullmatch(uuid) is None:
        return None
    try:
        parent = (sysfs_root / "bus" / "mdev" / "devices" / uuid).resolve(strict=True).parent
    except OSError:
        return None
    return parent.name if is_address(parent.name) else None


def resolve_claim(
    facts: DomainFacts,
    token_for_address: Callable[[str], str | None],
    parent_of_mdev: Callable[[str], str | None],
) -> DomainClaim | None:
    """Map the XML's devices to tokens; the claim element overrides mode and adds tokens.

    PCI hostdevs make an exclusive claim; mdevs alone a shared one.  Devices that
    belong to no token (a NIC passed through) are not the arbiter's business.
    """
    exclusive = [t for t in map(token_for_address, facts.pci_addresses) if t is not None]
    shared = []
    for uuid in facts.mdev_uuids:
        parent = parent_of_mdev(uuid)
        token = token_for_address(parent) if parent else None
        if token is not None:
            shared.append(token)
    tokens = tuple(dict.fromkeys([*exclusive, *shared, *facts.tokens]))
    if not tokens:
        return None
    mode = facts.mode or (Mode.EXCLUSIVE if exclusive else Mode.SHARED)
    if not facts.mode and not exclusive and not shared:
        mode = Mode.EXCLUSIVE  # a claim element naming tokens without a mode
    return DomainClaim(
        mode=mode,
        tokens=tokens,
        preemptible=bool(facts.preemptible),
        transient=bool(facts.transient),
        stop=facts.stop,
    )
