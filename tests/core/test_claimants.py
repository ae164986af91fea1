"""`Claimant.parse`: each kind's names by the rules of what they name.

libvirt: anything but '/' (domain_conf.c refuses it in a domain's name; spaces and
quotes are legal).  systemd: unit_name_is_valid's grammar (src/basic/unit-name.c):
PREFIX[@INSTANCE].TYPE, letters, digits and `:-_.\\` before the type, `@` after a
non-empty prefix, a type among systemd.unit(5)'s, at most 255 bytes (device, mount
and swap units, named after paths, 4095).  container: Podman's and Docker's
`[a-zA-Z0-9][a-zA-Z0-9_.-]*`.  process: a pid.  No kind: control or format
characters, which no terminal shows as they are.
"""

from __future__ import annotations

import pytest

from charly_arbiter.core.model import UNIT_SUFFIXES, Claimant
from charly_arbiter.errors import EXIT_USAGE, InvalidClaimant

VALID = [
    "libvirt:win11",
    "libvirt:my vm",
    'libvirt:it\'s "quoted" $(x) ; a|b',
    "libvirt:-rf",
    "libvirt:虚拟机",
    "libvirt:a\u00a0b",  # a no-break space is a space
    "libvirt:" + "x" * 1024,
    "libvirt:..",
    "libvirt:a:b",
    "systemd:ollama.service",
    "systemd:getty@tty1.service",
    "systemd:0@@.service",  # instance "@": the first @ ends the template's name
    "systemd:a\\x2db.service",
    "systemd:-.slice",
    "systemd:-.mount",
    "systemd:dev-sda1.device",
    "systemd:foo:bar.socket",
    "systemd:" + "a" * 247 + ".service",  # 255 bytes
    "systemd:" + "a" * 4089 + ".mount",  # 4095 bytes
    "container:llm",
    "container:a",
    "container:My_box-1.2",
    "container:" + "f" * 64,  # an id
    "process:1",
    "process:4194304",
    "nvidia-persistence:0000:0a:00.0",
]
INVALID = [
    ("nocolon", "KIND:NAME"),
    ("vm:x", "the kind is one of libvirt, systemd, container, process"),
    ("Libvirt:x", "the kind is one of"),
    ("libvirt:", "1 to 1024"),
    ("libvirt:" + "x" * 1025, "1 to 1024"),
    ("libvirt:a/b", "cannot contain '/'"),
    ("libvirt:a\tb", "control characters"),
    ("libvirt:a\nb", "control characters"),
    ("libvirt:a\x85b", "control characters"),  # a C1 control
    ("libvirt:a\u202eb", "control characters"),  # right-to-left override
    ("libvirt:a\u2028b", "control characters"),  # line separator
    ("systemd:ollama", "ends with its type"),
    ("systemd:ollama.exe", "ends with its type"),
    ("systemd:.service", "ends with its type"),
    ("systemd:a b.service", "only letters, digits"),
    ("systemd:a/b.service", "only letters, digits"),
    ("systemd:@a.service", "cannot start with @"),
    ("systemd:getty@.service", "template"),
    ("systemd:" + "a" * 248 + ".service", "at most 255 bytes"),
    ("systemd:caf\u00e9.service", "only letters"),
    ("systemd:" + "a" * 4090 + ".mount", "at most 4095 bytes"),
    ("container:-x", "container name"),
    ("container:my llm", "container name"),
    ("container:.hidden", "container name"),
    ("container:虚拟", "container name"),
    ("process:0", "process:PID"),
    ("process:12a", "process:PID"),
    ("process:-1", "process:PID"),
    ("process:\uff11\uff12", "process:PID"),  # fullwidth digits are digits, not a pid
    ("nvidia-persistence:gpu0", "PCI address"),
]


@pytest.mark.parametrize("text", VALID, ids=[v[:30] for v in VALID])
def test_a_name_its_kind_can_have_is_a_claimant(text: str) -> None:
    claimant = Claimant.parse(text)
    assert claimant == text and f"{claimant.kind}:{claimant.name}" == text


@pytest.mark.parametrize(("text", "why"), INVALID, ids=[i[0][:30] for i in INVALID])
def test_a_name_its_kind_cannot_have_is_a_usage_error_saying_why(text: str, why: str) -> None:
    with pytest.raises(InvalidClaimant) as error:
        Claimant.parse(text)
    assert why in str(error.value)
    assert error.value.exit_code == EXIT_USAGE


def test_every_unit_type_of_systemd_is_a_suffix() -> None:
    for suffix in UNIT_SUFFIXES:
        assert Claimant.parse(f"systemd:x.{suffix}").name == f"x.{suffix}"
    assert len(UNIT_SUFFIXES) == 11
