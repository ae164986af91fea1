"""The configuration files, read as qemu-server and pve-container read them: every
hostpci grammar form, the sections, the override, a container's device lines,
the PCI mapping file and the reservations.  Hostile or malformed input fails
closed with a sentence that names the line (docs/proxmox.md has the sources)."""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core.model import Mode
from charly_arbiter.errors import ArbiterError
from charly_arbiter.proxmox.mapping import (
    Reservation,
    in_use_by_others,
    parse_map_entry,
    parse_mappings,
    read_reservations,
)
from charly_arbiter.proxmox.vmconf import (
    ContainerDevices,
    GuestConfigError,
    Override,
    PciId,
    container_devices,
    decode_text,
    hostpci_lines,
    parse_ct_config,
    parse_hostpci,
    parse_override,
    parse_vm_config,
)
from tests.proxmox.conftest import CONFIGS, config_text


def vm(text: str) -> list[tuple[str, str]]:
    return list(parse_vm_config(text.encode(), "proxmox:100").settings)


# -- hostpciN: every form of the grammar ---------------------------------------------------

ID = PciId
VALID = [
    ("0a:00", (ID("0000", "0a", "00"),), None, ()),
    ("0a:00.1", (ID("0000", "0a", "00", "1"),), None, ()),
    ("0000:0a:00.0", (ID("0000", "0a", "00", "0"),), None, ()),
    ("host=0a:00.0", (ID("0000", "0a", "00", "0"),), None, ()),
    ("10000:e1:1f.7", (ID("10000", "e1", "1f", "7"),), None, ()),
    ("0a:00.0;0a:00.1", (ID("0000", "0a", "00", "0"), ID("0000", "0a", "00", "1")), None, ()),
    (
        "host=0000:0a:00.0;0000:0b:00.0,pcie=1",
        (ID("0000", "0a", "00", "0"), ID("0000", "0b", "00", "0")),
        None,
        (("pcie", "1"),),
    ),
    (
        "0a:00,pcie=on,x-vga=yes,rombar=0,romfile=vbios.bin",
        (ID("0000", "0a", "00"),),
        None,
        (("pcie", "1"), ("rombar", "0"), ("romfile", "vbios.bin"), ("x-vga", "1")),
    ),
    ("mapping=gpu-pool,pcie=1", (), "gpu-pool", (("pcie", "1"),)),
    ("0a:00.0,mdev=nvidia-63", (ID("0000", "0a", "00", "0"),), None, (("mdev", "nvidia-63"),)),
    (
        "00:02.0,mdev=i915-GVTg_V5_4",
        (ID("0000", "00", "02", "0"),),
        None,
        (("mdev", "i915-GVTg_V5_4"),),
    ),
    ("00:02.0,legacy-igd=1", (ID("0000", "00", "02", "0"),), None, (("legacy-igd", "1"),)),
    (
        "02:00,device-id=0x10f6,sub-vendor-id=0x0000",
        (ID("0000", "02", "00"),),
        None,
        (("device-id", "0x10f6"), ("sub-vendor-id", "0x0000")),
    ),
    ("0a:00,,pcie=0,", (ID("0000", "0a", "00"),), None, (("pcie", "0"),)),
]


@pytest.mark.parametrize(("value", "host", "mapping", "options"), VALID, ids=[v[0] for v in VALID])
def test_every_hostpci_form_parses(value, host, mapping, options) -> None:
    parsed = parse_hostpci("hostpci0", value)
    assert (parsed.host, parsed.mapping, parsed.options) == (host, mapping, options)


def test_an_option_this_version_does_not_know_is_kept_aside() -> None:
    parsed = parse_hostpci("hostpci0", "0a:00,pcie=1,future-option=5")
    assert parsed.unknown == ("future-option",)
    assert parsed.host == (ID("0000", "0a", "00"),)


INVALID = [
    ("0A:00.0", "not a PCI id"),
    ("0a:00.8", "function above 7"),
    ("0a:20.0", "device number above 1f"),
    ("a:00.0", "not a PCI id"),
    ("0a:0.0", "not a PCI id"),
    ("0a:00.0.1", "not a PCI id"),
    ("123456789:0a:00.0", "longer than 8"),
    ("0a:00.0;", "not a PCI id"),
    (";0a:00.0", "not a PCI id"),
    ("0a:00 .0", "not a PCI id"),
    ("", "neither host nor mapping"),
    ("pcie=1", "neither host nor mapping"),
    ("host=0a:00,mapping=pool", "both host and mapping"),
    ("0a:00,0b:00", "given twice"),
    ("0a:00,pcie=1,pcie=0", "given twice"),
    ("host=", "not KEY=VALUE"),
    ("=0a:00", "not KEY=VALUE"),
    ("0a:00,pcie=maybe", "not a boolean"),
    ("0a:00,romfile=a;b", "not valid"),
    ("0a:00,vendor-id=10de", "not valid"),
    ("0a:00,mdev=../x", "not valid"),
    ("0a:00.0;0a:00.1,mdev=nvidia-63", "mediated device"),
    ("mapping=../../etc/passwd", "not a mapping id"),
    ("0a:00.0\x00", "not a PCI id"),
]


@pytest.mark.parametrize(("value", "why"), INVALID, ids=[repr(v[0]) for v in INVALID])
def test_a_malformed_hostpci_fails_closed_with_a_sentence(value: str, why: str) -> None:
    config = parse_vm_config(f"name: x\nhostpci3: {value}\n".encode(), "proxmox:100")
    with pytest.raises(GuestConfigError) as error:
        hostpci_lines(config)
    message = str(error.value)
    assert "proxmox:100" in message and "hostpci3" in message and why in message, message
    assert error.value.hint and "docs/proxmox.md" in error.value.hint


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("hostpci16: 0a:00\n", "hostpci0 to hostpci15"),
        ("hostpci01: 0a:00\n", "hostpci0 to hostpci15"),
        ("hostpci0: 0a:00\nhostpci0: 0b:00\n", "set twice"),
    ],
)
def test_hostpci_keys_outside_qemu_servers_range_fail_closed(text: str, why: str) -> None:
    with pytest.raises(GuestConfigError, match=why):
        hostpci_lines(parse_vm_config(text.encode(), "proxmox:100"))


def test_pci_ids_cover_functions_as_lspci_matches_them() -> None:
    slot = ID("0000", "0a", "00")
    assert slot.covers("0000:0a:00.0") and slot.covers("0000:0a:00.1")
    assert not slot.covers("0000:0a:01.0") and not slot.covers("0001:0a:00.0")
    one = ID("0000", "0a", "00", "1")
    assert one.covers("0000:0a:00.1") and not one.covers("0000:0a:00.0")


# -- sections, description, tags -----------------------------------------------------------


def test_only_the_main_section_counts() -> None:
    config = parse_vm_config(config_text("vm-100-win11.conf").encode(), "proxmox:100")
    assert config.get("hostpci0") == "0000:0a:00,pcie=1,x-vga=1"  # not the snapshot's 0b:00
    assert (
        config.description == "Gaming VM: the whole RTX 4090 (GPU and HDMI audio), primary display"
    )
    assert config.get("snaptime") is None
    pending = parse_vm_config(config_text("vm-102-mapping.conf").encode(), "proxmox:102")
    assert pending.get("hostpci1") is None and pending.get("memory") == "16384"


@pytest.mark.parametrize(
    "header", ["[PENDING]", "[pending]", "[special:cloudinit]", "[snap1]", "[what ever]"]
)
def test_any_section_header_ends_the_main_section(header: str) -> None:
    assert vm(f"name: a\n{header}\nhostpci0: 0a:00\n") == [("name", "a")]


def test_description_lines_are_percent_decoded_utf8_and_key_lines_join_them() -> None:
    text = "#caf%C3%A9 %3A one\n#two\ndescription: three%3A\nname: x\n"
    config = parse_vm_config(text.encode(), "proxmox:100")
    assert config.description == "café : one\ntwo\nthree:"
    assert decode_text("%E2%9C%93%zz") == "✓%zz"


def test_lines_proxmox_ignores_are_ignored() -> None:
    assert vm("Name: x\nhostpci0 = 0a:00\n  indented: y\nmemory: 1024\n") == [("memory", "1024")]


def test_tags_split_as_proxmox_splits_them() -> None:
    config = parse_vm_config(b"tags: a;b,c  d\n", "proxmox:100")
    assert config.tags == ("a", "b", "c", "d")


# -- the override ------------------------------------------------------------------------------


def override(description: str = "", tags: str = "") -> Override:
    text = "".join(f"#{line}\n" for line in description.splitlines())
    text += f"tags: {tags}\n" if tags else ""
    return parse_override(parse_vm_config(text.encode(), "proxmox:100"))


@pytest.mark.parametrize(
    ("description", "tags", "expected"),
    [
        ("", "", Override()),
        ("just a note", "web;prod", Override()),
        (
            "charly-arbiter%3A mode=shared tokens=gpu0,gpu1 preemptible=yes transient=no stop=stop",
            "",
            Override(Mode.SHARED, ("gpu0", "gpu1"), True, False, "stop", True),
        ),
        ("notes\n  Charly-Arbiter%3A preemptible=on", "", Override(preemptible=True, present=True)),
        ("", "charly-preemptible;web", Override(preemptible=True, present=True)),
        ("", "CHARLY-SHARED", Override(mode=Mode.SHARED, present=True)),
        (
            "",
            "charly-exclusive,charly-transient",
            Override(Mode.EXCLUSIVE, transient=True, present=True),
        ),
        (
            "charly-arbiter%3A mode=shared",
            "charly-shared",
            Override(mode=Mode.SHARED, present=True),
        ),
    ],
)
def test_the_override_reads_description_and_tags(description, tags, expected) -> None:
    assert override(description, tags) == expected


@pytest.mark.parametrize(
    ("description", "tags", "why"),
    [
        ("charly-arbiter%3A mode=both", "", "not exclusive or shared"),
        ("charly-arbiter%3A preemptible=perhaps", "", "not yes or no"),
        ("charly-arbiter%3A stop=destroy", "", "stop='destroy'"),
        ("charly-arbiter%3A tokens=", "", "not a list of token names"),
        ("charly-arbiter%3A tokens=gpu0,../x", "", "not a list of token names"),
        ("charly-arbiter%3A colour=blue", "", "is not one of mode="),
        ("charly-arbiter%3A shared", "", "is not one of mode="),
        ("charly-arbiter%3A mode=shared mode=exclusive", "", "given twice"),
        ("charly-arbiter%3A mode=shared\ncharly-arbiter%3A mode=shared", "", "2 charly-arbiter"),
        ("", "charly-preemptibel", "is not one of charly-exclusive"),
        ("charly-arbiter%3A mode=exclusive", "charly-shared", "contradicts mode"),
        ("", "charly-shared;charly-exclusive", "contradicts mode"),
    ],
)
def test_an_override_it_cannot_read_fails_closed(description, tags, why) -> None:
    with pytest.raises(GuestConfigError) as error:
        override(description, tags)
    assert "override" in str(error.value) and why in str(error.value), str(error.value)


# -- containers ------------------------------------------------------------------------------


def ct(text: str) -> ContainerDevices:
    return container_devices(parse_ct_config(text.encode(), "lxc:200"))


@pytest.mark.parametrize(
    ("text", "paths", "numbers"),
    [
        ("dev0: /dev/dri/renderD128,gid=104\n", ("/dev/dri/renderD128",), ()),
        ("dev1: path=/dev/dri/card0,mode=0660\n", ("/dev/dri/card0",), ()),
        ("dev0: mode=0666,path=/dev/nvidia0\n", ("/dev/nvidia0",), ()),
        ("dev0: /dev/../etc/shadow\ndev1: /tmp/x\ndev2: /dev/./dri\n", (), ()),
        (
            "lxc.mount.entry: /dev/dri dev/dri none bind,optional,create=dir\n",
            ("/dev/dri",),
            (),
        ),
        (
            "lxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n",
            ("/dev/nvidia0",),
            (),
        ),
        ("lxc.mount.entry: /dev/dri\\040x dev/x none bind\n", ("/dev/dri x",), ()),
        ("lxc.mount.entry: /mnt/data mnt none bind\n", (), ()),
        ("lxc.cgroup2.devices.allow: c 226:* rwm\n", (), ((226, None),)),
        ("lxc.cgroup.devices.allow: c 195:0 rw\n", (), ((195, 0),)),
        ("lxc.cgroup2.devices.allow: a\nlxc.cgroup2.devices.allow: c *:* rwm\n", (), ()),
        ("lxc.cgroup2.devices.allow: b 8:0 rwm\nlxc.cgroup2.devices.allow: c x:1 r\n", (), ()),
        ("[snap]\ndev0: /dev/dri/card0\n", (), ()),
    ],
)
def test_a_containers_device_lines(text: str, paths, numbers) -> None:
    assert ct(text) == ContainerDevices(paths, numbers)


def test_the_recorded_containers_devices() -> None:
    assert ct(config_text("ct-200-jellyfin.conf")).paths == ("/dev/dri/renderD128",)
    ollama = ct(config_text("ct-201-ollama.conf"))
    assert (ollama.paths, ollama.numbers) == (("/dev/dri",), ((226, None),))
    whisper = ct(config_text("ct-202-whisper.conf"))
    assert (whisper.paths, whisper.numbers) == (("/dev/dri/renderD129",), ((226, 129),))


# -- the PCI mapping file and the reservations ---------------------------------------------------


def test_the_mapping_file_as_section_config_reads_it() -> None:
    mappings = parse_mappings(config_text("pci.cfg"))
    assert sorted(mappings) == ["audio-only", "gpu-pool"]
    here = mappings["gpu-pool"].on_node("pve1")
    assert [str(entry.path[0]) for entry in here] == ["0000:0a:00", "0000:0b:00"]
    assert (here[0].device_id, here[0].iommu_group) == ("10de:2684", 12)
    assert [str(e.path[0]) for e in mappings["gpu-pool"].on_node("pve2")] == ["0000:01:00"]
    assert mappings["gpu-pool"].on_node("pve3") == []


def test_mapping_sections_and_entries_proxmox_skips_are_skipped() -> None:
    text = (
        "# a comment\n"
        "bad id!\n\tmap node=pve1,path=0000:0a:00,id=10de:2684\n\n"
        "pool\n"
        "\tmap node=pve1,path=0a:00,id=10de:2684\n"  # no domain: not a mapping path
        "\tmap node=pve1,path=0000:0a:00,id=nvidia\n"
        "\tmap node=pve1,path=0000:0a:00,id=10de:2684,colour=red\n"
        "\tmap node=pve1,path=0000:0b:00.0,id=10de:2204\n"
    )
    mappings = parse_mappings(text)
    assert list(mappings) == ["pool"]
    assert [str(e.path[0]) for e in mappings["pool"].entries] == ["0000:0b:00.0"]


@pytest.mark.parametrize(
    "value",
    [
        "node=pve1,id=10de:2684",
        "path=0000:0a:00,id=10de:2684",
        "node=pve1,path=0000:0a:00",
        "node=pve1,node=pve2,path=0000:0a:00,id=10de:2684",
    ],
)
def test_a_map_entry_without_what_it_needs_is_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_map_entry(value)


def test_reservations_as_qemu_server_writes_them(tmp_path: Path) -> None:
    (tmp_path / "pci-id-reservations").write_text(
        "0000:0a:00.0 100 pid:4242\n0000:0b:00.0 101 time:2000\n0c:00.0 102 time:9999\ngarbage\n"
    )
    found = read_reservations(tmp_path)
    assert found == [
        ("0000:0a:00.0", Reservation("100", pid=4242)),
        ("0000:0b:00.0", Reservation("101", until=2000)),
        ("0c:00.0", Reservation("102", until=9999)),
    ]
    slot = (ID("0000", "0a", "00"),)
    alive = {4242}.__contains__
    assert in_use_by_others(slot, found, "105", alive, now=1000) == "100"
    assert in_use_by_others(slot, found, "100", alive, now=1000) is None  # its own
    assert in_use_by_others(slot, found, "105", lambda pid: False, now=1000) is None  # dead
    gpu1 = (ID("0000", "0b", "00", "0"),)
    assert in_use_by_others(gpu1, found, "105", alive, now=1000) == "101"
    assert in_use_by_others(gpu1, found, "105", alive, now=3000) is None  # expired
    assert in_use_by_others((ID("0000", "0c", "00"),), found, "105", alive, now=1) == "102"
    assert read_reservations(tmp_path / "none") == []


def test_every_recorded_config_has_its_source_noted() -> None:
    sources = (CONFIGS / "SOURCES.md").read_text()
    for path in CONFIGS.iterdir():
        if path.suffix in (".conf", ".cfg"):
            assert f"`{path.name}`" in sources, path.name


def test_errors_are_arbiter_errors_with_a_hint() -> None:
    error = GuestConfigError("proxmox:100", "why", Path("/etc/pve/qemu-server/100.conf"))
    assert isinstance(error, ArbiterError) and "/etc/pve/qemu-server/100.conf" in str(error.hint)
