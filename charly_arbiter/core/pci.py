"""PCI addresses, validated strictly before they come near a path.

An address is the only user-influenced string that becomes part of a sysfs
path, so it is checked once here, against one pattern, and carried around as
a validated `str` afterwards.
"""

from __future__ import annotations

import re

from charly_arbiter.errors import InvalidAddress

# Domain of 4 to 8 hex digits (VMD and some hosts use 10000:…), bus, device
# 0x00-0x1f, function 0-7.  Lower case only: sysfs never spells them otherwise.
_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]")


def parse_address(text: str) -> str:
    """Return `text` when it is a canonical PCI address, else raise `InvalidAddress`."""
    if not isinstance(text, str) or _ADDRESS.fullmatch(text) is None:
        raise InvalidAddress(str(text))
    return text


def is_address(text: str) -> bool:
    return isinstance(text, str) and _ADDRESS.fullmatch(text) is not None


def slot_of(address: str) -> str:
    """`0000:0a:00.1` -> `0000:0a:00` (the functions of one device share it)."""
    return address.rsplit(".", 1)[0]


def from_libvirt(domain: str, bus: str, slot: str, function: str) -> str:
    """Build an address from the hex attributes of a libvirt `<address>` element."""
    try:
        parts = [int(value, 16) for value in (domain, bus, slot, function)]
    except (TypeError, ValueError) as error:
        raise InvalidAddress(f"{domain}:{bus}:{slot}.{function}") from error
    dom, bus_no, slot_no, func = parts
    return parse_address(f"{dom:04x}:{bus_no:02x}:{slot_no:02x}.{func:x}")


def vf_address(pf: str, index: int, offset: int = 1, stride: int = 1) -> str:
    """Where the kernel puts a physical function's virtual function `index`: the PF's
    routing id (bus << 8 | device << 3 | function) + offset + index * stride, as
    pci_iov_virtfn_bus/devfn compute it from `sriov_offset` and `sriov_stride`."""
    domain, bus, slot_function = parse_address(pf).split(":")
    slot, function = slot_function.split(".")
    rid = (int(bus, 16) << 8 | int(slot, 16) << 3 | int(function, 16)) + offset + index * stride
    return f"{domain}:{rid >> 8:02x}:{(rid >> 3) & 0x1F:02x}.{rid & 7:x}"
