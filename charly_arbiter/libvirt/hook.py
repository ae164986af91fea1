"""`charly-arbiter hook qemu GUEST OP SUBOP EXTRA`: what libvirt's qemu hook runs.

libvirt waits for this on every VM start and stop, so the path for a domain
that claims nothing imports almost nothing (`os` and `sys`): hooks/qemu has
already let through only the operations handled here and XML that mentions a
hostdev or a claim element; this scans the XML's bytes once more and looks at
each PCI hostdev's class in sysfs, so that a VM with a NIC or a USB controller
passed through is let go before the configuration, the ledger or libvirt are
loaded; a `release` of a domain the ledger's bytes do not name (every refused
start) is let go the same way.  Everything after that is `hookrun`, imported here
and only here, unless the resident helper takes it (`serve`: the same command,
with the XML read here, in a process that has imported everything already).

Contract (docs/libvirt.md): nothing on stdout (libvirt reads it as XML for
some operations); `prepare` refuses with a non-zero exit and one or two
sentences on stderr; `release` and `reconnect` always exit 0; `migrate`
refuses a domain with an exclusive claim; every other operation exits 0 at
once.  Exit codes follow the CLI's contract (1 error, 2 usage or a guest name no
claimant can have, 3 refused).  The guest name is untrusted: it only ever
becomes `libvirt:NAME`, and only after the XML says the domain may claim a GPU.
"""

from __future__ import annotations

import os
import sys

from charly_arbiter.hookio import (
    configured_ledger_may_name,
    guarded,
    python_with_site,
    say,
    scan_config,
)

HANDLED = {"prepare": "begin", "release": "end", "reconnect": "begin", "migrate": "begin"}
ALWAYS_SUCCEED = ("release", "reconnect")
# Above libvirt's own 10 MiB: a domain whose XML is larger is refused at prepare
# rather than read in part (a hostdev past the part read would pass unclaimed).
# The same bound as domainxml.MAX_XML_BYTES (not imported: the fast path stays light).
MAX_XML = 16 << 20
# Without one of these bytes the XML cannot claim (the domainxml rules, without
# importing them: the fast path stays at the cost of starting Python).
CLAIM_MARKERS = (b"hostdev", b"https://charly-arbiter.org/xmlns/claim/1")
# Where the fast path looks: host/sysfs.HOST_ROOTS.sys, spelled here so that it
# imports nothing (tests/host/test_sysfs.py holds the two equal).
SYS_ROOT = "/sys"
DISPLAY_CLASS = "0x03"
USAGE = "usage: charly-arbiter hook qemu GUEST OPERATION SUB-OPERATION EXTRA"


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(f"charly-arbiter: {USAGE}", file=sys.stderr)
        return 2
    driver, guest, operation, sub_operation = argv[:4]
    extra = argv[4] if len(argv) > 4 else "-"
    if driver != "qemu" or HANDLED.get(operation) != sub_operation:
        return 0
    # libvirt goes on only on 0: a refused (3), unusable (2) or failed (1) prepare
    # keeps the VM from starting; a stop is never held back.
    return guarded(
        lambda: _dispatch(argv, guest, operation, extra),
        what=f"the {operation} hook for {guest!r}",
        lets_go=lambda: operation in ALWAYS_SUCCEED,
    )


def _dispatch(argv: list[str], guest: str, operation: str, extra: str) -> int:
    xml = _read_stdin()
    if operation == "release" and not configured_ledger_may_name(f"libvirt:{guest}"):
        # The ledger alone decides a release, and it names nothing of this domain's:
        # a refused start, a VM that claims nothing.  Nothing to release, no Python.
        return 0
    # Too large to read whole: refused at prepare; otherwise the ledger decides.
    oversized = len(xml) > MAX_XML
    if oversized and operation == "prepare":
        say(
            f"the domain XML of {guest!r} is larger than {MAX_XML >> 20} MiB; "
            "it is refused rather than read in part",
            "shorten its <description> or metadata",
        )
        return 1
    if not oversized and not may_claim(xml):
        return 0  # the fast path: no GPU hostdev, no claim element
    from charly_arbiter.serve.client import forward

    served = forward(["hook", *argv], xml)
    if served is not None:
        return served
    python_with_site()
    from charly_arbiter.libvirt import hookrun

    return hookrun.dispatch(guest, operation, extra, None if oversized else xml)


def may_claim(xml: bytes, sys_root: str | None = None, config: str | None = None) -> bool:
    """Whether the domain may claim a GPU; False only when sure it cannot.

    Sure means: no claim element, and every hostdev is a PCI function whose class
    in sysfs is not a display controller, with no display function in its IOMMU
    group (an audio function passed alone still claims its GPU's token), and
    whose address the configuration does not name (a token may be anything).
    Anything unexpected (an mdev, an address not in sysfs, an odd XML) says
    "may": the slow path parses it properly.
    """
    if CLAIM_MARKERS[1] in xml:
        return True
    if CLAIM_MARKERS[0] not in xml:
        return False
    addresses = _pci_hostdev_addresses(xml)
    if addresses is None:
        return True
    if any(_near_a_display(address, sys_root or SYS_ROOT) for address in addresses):
        return True
    return _config_decides(addresses, config)


def _pci_hostdev_addresses(xml: bytes) -> list[str] | None:
    """The source address of every PCI hostdev; None where a hostdev is not plainly one."""
    addresses = []
    for chunk in xml.split(b"<hostdev")[1:]:
        head, _, body = chunk.partition(b">")
        if b"type='pci'" not in head and b'type="pci"' not in head:
            if b"type='usb'" in head or b'type="usb"' in head:
                continue  # a USB device is never a GPU
            return None
        source = body.partition(b"</source>")[0].partition(b"<source")[2]
        address = _address(source.partition(b"<address")[2].partition(b">")[0])
        if address is None:
            return None
        addresses.append(address)
    return addresses


def _address(attributes: bytes) -> str | None:
    """`domain='0x0000' bus='0x0a' slot='0x00' function='0x0'` -> `0000:0a:00.0`: the
    numbers core/pci.from_libvirt accepts (tests/core/test_pci_grammars.py holds the
    two to the same verdicts), without importing it."""
    parts = []
    for name in (b"domain", b"bus", b"slot", b"function"):
        _, found, rest = attributes.partition(b" " + name + b"=")
        if not found or rest[:1] not in (b"'", b'"'):
            return None
        value = rest[1:].partition(rest[:1])[0]
        try:
            parts.append(int(value, 16))
        except ValueError:
            return None
    domain, bus, slot, function = parts
    if not (0 <= domain <= 0xFFFFFFFF and 0 <= bus <= 0xFF and 0 <= slot <= 0x1F):
        return None
    if not 0 <= function <= 7:
        return None
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


def _near_a_display(address: str, sys_root: str) -> bool:
    """A display function, or one in the IOMMU group (or, without one, the slot) of one;
    unknown counts as yes."""
    device = f"{sys_root}/bus/pci/devices/{address}"
    group = f"{device}/iommu_group/devices"
    try:
        members = os.listdir(group) if os.path.isdir(group) else None
        if members is None:
            slot = address.rpartition(".")[0]
            members = [m for m in os.listdir(f"{sys_root}/bus/pci/devices") if m.startswith(slot)]
        if address not in members:
            return True
        for member in members:
            with open(f"{sys_root}/bus/pci/devices/{member}/class") as handle:
                if handle.read().startswith(DISPLAY_CLASS):
                    return True
    except OSError:
        return True
    return False


def _config_decides(addresses: list[str], config: str | None) -> bool:
    """Whether the configuration must be read after all: it mentions one of the
    addresses (a token may be anything), or its host is simulated (sysfs then
    says nothing about the host's PCI).  The bytes are scanned, not parsed."""
    scan = scan_config(config)
    if scan is None:
        return True
    simulated, text = scan
    return simulated or any(address.encode() in text for address in addresses)


def _read_stdin() -> bytes:
    """The whole XML up to MAX_XML bytes (one byte more says it was larger)."""
    try:
        return sys.stdin.buffer.read(MAX_XML + 1)
    except (OSError, ValueError, AttributeError):
        return b""
