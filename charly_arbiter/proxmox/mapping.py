"""The cluster's PCI mappings and qemu-server's PCI reservations.

`/etc/pve/mapping/pci.cfg` is a PVE::SectionConfig file whose section header is
the mapping's id alone (PVE::Mapping::PCI in pve-guest-common): indented
`KEY VALUE` lines follow, `map` once per node entry, each a property string
`node=NODE,path=ID[;ID…],id=VENDOR:DEVICE[,iommugroup=N][,subsystem-id=…]`; a
blank line ends a section and `#` lines are comments.  A hostpci line's
`mapping=ID` passes the devices of the entries for this node: each entry is one
alternative (qemu-server's parse_hostpci), the ids of one entry's path are
passed together, and qemu-server takes the first alternative that no other
running VM has reserved in `/run/qemu-server/pci-id-reservations` (lines `ID
VMID time:EXPIRY` or `ID VMID pid:PID`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.errors import ArbiterError
from charly_arbiter.proxmox.vmconf import MAX_CONFIG_BYTES, PciId, parse_pci_id

log = logging.getLogger(__name__)

MAPPING_FILE = Path("mapping") / "pci.cfg"
RESERVATIONS_FILE = "pci-id-reservations"
MAP_KEYS = ("node", "path", "id", "subsystem-id", "iommugroup", "description")
_HEADER = re.compile(r"(\S+)\s*")
_BODY = re.compile(r"\s+(\S+)(?:\s+(.*\S))?\s*")
_CONFIG_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_DEVICE_ID = re.compile(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}")
_RESERVATION = re.compile(
    r"((?:[a-f0-9]{4,}:)?[a-f0-9]{2}:[a-f0-9]{2}(?:\.[a-f0-9])?)\s(\d+)\s(time|pid):(\d+)"
)


class MappingError(ArbiterError):
    """A hostpci line's mapping that cannot be resolved on this node."""

    def __init__(self, guest: str, mapping: str, why: str) -> None:
        super().__init__(
            f"{guest} cannot use PCI mapping {mapping!r}: {why}",
            hint="check Datacenter > Resource Mappings (or /etc/pve/mapping/pci.cfg) for "
            "this node; Proxmox would refuse this start too",
        )


@dataclass(frozen=True)
class MapEntry:
    """One node's device in a mapping."""

    node: str
    path: tuple[PciId, ...]  # passed together
    device_id: str  # vendor:device, lower case
    iommu_group: int | None = None


@dataclass(frozen=True)
class PciMapping:
    name: str
    entries: tuple[MapEntry, ...] = ()

    def on_node(self, node: str) -> list[MapEntry]:
        return [entry for entry in self.entries if entry.node == node]


def read_mappings(config_dir: Path) -> dict[str, PciMapping]:
    """The cluster's PCI mappings (none when the file does not exist)."""
    path = config_dir / MAPPING_FILE
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise ArbiterError(f"{path} cannot be read ({error.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ArbiterError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    return parse_mappings(data.decode("utf-8", "replace"), str(path))


def parse_mappings(text: str, source: str = "pci.cfg") -> dict[str, PciMapping]:
    """Sections as PVE::SectionConfig reads them; a section or entry Proxmox would skip
    (a bad id, a map entry it cannot parse) is skipped here too, and logged."""
    found: dict[str, PciMapping] = {}
    lines = [line for line in text.split("\n") if not line.lstrip().startswith("#")]
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if not line.strip():
            continue
        header = _HEADER.fullmatch(line)
        body: list[str] = []
        while index < len(lines) and lines[index].strip():
            body.append(lines[index])
            index += 1
        if header is None or _CONFIG_ID.fullmatch(header.group(1)) is None:
            log.warning("%s: section %r skipped, as Proxmox skips it", source, line)
            continue
        name = header.group(1)
        entries = []
        for item in body:
            match = _BODY.fullmatch(item)
            if match is None or match.group(1) != "map":
                continue
            try:
                entries.append(parse_map_entry(match.group(2) or ""))
            except ValueError as error:
                log.warning("%s: mapping %s: a map entry is skipped: %s", source, name, error)
        found[name] = PciMapping(name, tuple(entries))
    return found


def parse_map_entry(value: str) -> MapEntry:
    """`node=…,path=…,id=…[,iommugroup=…]…`; raises ValueError."""
    parts: dict[str, str] = {}
    for part in value.split(","):
        if not part.strip():
            continue
        name, sep, text = part.partition("=")
        if not sep or not text or name not in MAP_KEYS:
            raise ValueError(f"{part!r} is not one of {', '.join(MAP_KEYS)}")
        if name in parts:
            raise ValueError(f"{name} is given twice")
        parts[name] = text
    for required in ("node", "path", "id"):
        if required not in parts:
            raise ValueError(f"it has no {required}")
    if _DEVICE_ID.fullmatch(parts["id"]) is None:
        raise ValueError(f"id {parts['id']!r} is not VENDOR:DEVICE")
    group = parts.get("iommugroup")
    if group is not None and not group.isdigit():
        raise ValueError(f"iommugroup {group!r} is not a number")
    path = tuple(parse_pci_id(item, require_domain=True) for item in parts["path"].split(";"))
    return MapEntry(parts["node"], path, parts["id"].lower(), int(group) if group else None)


# -- reservations -------------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    vmid: str
    pid: int | None = None  # the running VM's QEMU
    until: int | None = None  # a start's reservation, valid until then


def read_reservations(run_dir: Path) -> list[tuple[str, Reservation]]:
    """qemu-server's reservations: (pci id, reservation); none when there is no file."""
    try:
        text = (run_dir / RESERVATIONS_FILE).read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        match = _RESERVATION.fullmatch(line)
        if match is None:
            continue
        pci, vmid, kind, number = match.groups()
        if kind == "pid":
            found.append((pci, Reservation(vmid, pid=int(number))))
        else:
            found.append((pci, Reservation(vmid, until=int(number))))
    return found


def in_use_by_others(
    alternative: Sequence[PciId],
    reservations: Sequence[tuple[str, Reservation]],
    vmid: str,
    alive: Callable[[int], bool],
    now: float | None = None,
) -> str | None:
    """The VMID that holds a device of `alternative` by qemu-server's rules (a live
    reservation of another VM: a time one not yet expired, or a pid one whose
    process runs), or None."""
    moment = time.time() if now is None else now
    for pci, reservation in reservations:
        if reservation.vmid == vmid:
            continue
        address = pci if pci.count(":") == 2 else f"0000:{pci}"
        if not any(device.covers(address) for device in alternative):
            continue
        if reservation.until is not None and reservation.until > moment:
            return reservation.vmid
        if reservation.pid is not None and alive(reservation.pid):
            return reservation.vmid
    return None
