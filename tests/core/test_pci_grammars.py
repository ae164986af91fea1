"""One PCI address grammar: core/pci.py's, and every fast path held to its verdicts.

The hooks' fast paths cannot import it (they stay at the cost of starting Python:
no `re`, nothing of the arbiter), so they spell the grammar again; the libvirt
hook reads an address as a domain XML's hex attributes.  Each is fed the same
corpus of good and bad addresses here and must answer as core/pci.py does, as
must the places that reuse it (a claimant named after a GPU, the device-node
scan of sysfs paths).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from charly_arbiter.core.model import Claimant
from charly_arbiter.core.pci import from_libvirt, is_address, parse_address
from charly_arbiter.errors import ArbiterError, InvalidAddress
from charly_arbiter.host.devnodes import sysfs_function
from charly_arbiter.libvirt.hook import _address
from charly_arbiter.oci.hook import _is_pci_address

GOOD = [
    "0000:00:00.0",
    "0000:0a:00.0",
    "0000:0a:00.1",
    "0000:ff:1f.7",
    "0000:01:10.3",
    "10000:e1:00.0",  # a VMD domain
    "ffffffff:00:00.0",  # the widest domain
    "abcd:ef:0f.6",
]
BAD = [
    "",
    "0000:0a:00",  # no function
    "0000:0a:00.8",  # function past 7
    "0000:0a:20.0",  # device past 0x1f
    "0000:0a:ff.0",
    "000:0a:00.0",  # a short domain
    "123456789:0a:00.0",  # a domain past 8 digits
    "0000:a:00.0",  # a short bus
    "0000:0a:0.0",
    "0000:0A:00.0",  # upper case: sysfs never writes it
    "0000:0a:00.0 ",
    " 0000:0a:00.0",
    "0000:0a:00.00",
    "0000:0a:00:0",
    "0000:0g:00.0",
    "0000-0a-00.0",
    "0a:00.0",  # lspci's short form is not an address
    "0000:0a:00.0/..",
    "..",
    "0000:0a:00.-",
    "0000:0a:00.٣",  # an Arabic-Indic digit
]


def _claimant_verdict(text: str) -> bool:
    try:
        Claimant.parse(f"nvidia-persistence:{text}")
    except ArbiterError:
        return False
    return True


def _sysfs_verdict(text: str, tmp_path: Path) -> bool:
    """The device-node scan: a /sys/dev/char link whose target has `text` as a part."""
    if "/" in text or text in ("", ".", ".."):
        return False
    device = tmp_path / "devices" / "pci0000:00" / text / "drm" / "card1"
    device.mkdir(parents=True)
    (tmp_path / "dev" / "char").mkdir(parents=True)
    os.symlink(device, tmp_path / "dev" / "char" / "226:1")
    return sysfs_function(tmp_path, (226, 1)) == text


@pytest.mark.parametrize("text", GOOD + BAD)
def test_every_grammar_gives_core_pci_s_verdict(text: str, tmp_path: Path) -> None:
    expected = text in GOOD
    assert is_address(text) is expected
    verdicts = {
        "parse_address": _parses(text),
        "the claimant of a GPU": _claimant_verdict(text),
        "the OCI hook's fast path": _is_pci_address(text),
        "the device-node scan": _sysfs_verdict(text, tmp_path),
    }
    assert verdicts == dict.fromkeys(verdicts, expected)


def _parses(text: str) -> bool:
    try:
        return parse_address(text) == text
    except InvalidAddress:
        return False


def _attributes(domain: str, bus: str, slot: str, function: str) -> bytes:
    return f" domain='{domain}' bus='{bus}' slot='{slot}' function='{function}'".encode()


ATTRIBUTES = [
    *(
        ("0x" + a[: a.index(":")], "0x" + a.split(":")[1], "0x" + a.split(":")[2][:2], a[-1])
        for a in GOOD
    ),
    ("0x0000", "0x0A", "0x00", "0x0"),  # upper case is a number like any other
    ("0", "10", "1f", "7"),
    ("0x100000000", "0x00", "0x00", "0x0"),  # a domain past 32 bits
    ("0x0000", "0x100", "0x00", "0x0"),
    ("0x0000", "0x0a", "0x20", "0x0"),
    ("0x0000", "0x0a", "0x00", "0x8"),
    ("0x0000", "-0x1", "0x00", "0x0"),
    ("0x0000", "0x0g", "0x00", "0x0"),
    ("0x0000", "", "0x00", "0x0"),
]


@pytest.mark.parametrize("attributes", ATTRIBUTES, ids=str)
def test_the_libvirt_hook_reads_a_hostdev_address_as_core_pci_does(
    attributes: tuple[str, str, str, str],
) -> None:
    try:
        expected: str | None = from_libvirt(*attributes)
    except InvalidAddress:
        expected = None
    assert _address(_attributes(*attributes)) == expected
