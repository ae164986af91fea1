"""A Proxmox VM's claim, from its configuration: which tokens, in which mode.

- `hostpciN` passes PCI devices through: an exclusive claim on the token that
  owns each function (a device without a function: every function the token
  has in that slot).  qemu-server binds the devices' whole IOMMU group to
  vfio-pci, which is the token, so an audio function alone claims its GPU.
- `hostpciN` with `mdev=TYPE` makes a mediated device on the parent GPU, which
  stays on its own driver: a shared claim (qemu-server refuses mdev on several
  devices at once).  A VM with both kinds of line is refused: a claim has one
  mode.
- `mapping=ID` is resolved through the cluster's PCI mapping file for this
  node: the entry qemu-server will choose (the first that no other running VM
  has reserved), checked against the hardware as qemu-server checks it; for an
  mdev, every entry (qemu-server picks the one with a free instance only when
  it creates it), shared.
- The override (`charly-arbiter:` description line, `charly-…` tags) adds
  tokens and sets the mode, preemptible, transient and how to stop the VM.
- Devices of no token (a NIC) are not the arbiter's business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from charly_arbiter.core.host import TokenSpec
from charly_arbiter.core.model import Mode
from charly_arbiter.proxmox.mapping import (
    MapEntry,
    MappingError,
    PciMapping,
    Reservation,
    in_use_by_others,
)
from charly_arbiter.proxmox.vmconf import (
    GuestConfig,
    GuestConfigError,
    PciId,
    hostpci_lines,
    parse_override,
)


@dataclass(frozen=True)
class VmClaim:
    """The claim a VM makes when it starts (and holds while it runs)."""

    mode: Mode
    tokens: tuple[str, ...]
    preemptible: bool = False
    transient: bool = False
    stop: str = "shutdown"
    devices: tuple[str, ...] = field(default=(), compare=False)  # what was resolved, for logs


@dataclass(frozen=True)
class ProxmoxNode:
    """What resolving a mapping needs from the cluster and this node."""

    node: str
    mappings: Callable[[], dict[str, PciMapping]]
    reservations: Callable[[], list[tuple[str, Reservation]]]
    alive: Callable[[int], bool]


def vm_claim(
    vmid: str,
    config: GuestConfig,
    tokens: Sequence[TokenSpec],
    where: ProxmoxNode,
    *,
    running: bool = False,
) -> VmClaim | None:
    """The VM's claim, or None when it claims nothing.  `running`: the VM runs now (a
    holder), so a mapping's entry is the one reserved for it, not the next free one.
    Raises GuestConfigError or MappingError for what cannot be resolved for certain."""
    override = parse_override(config)
    exclusive: list[str] = []
    shared: list[str] = []
    devices: list[str] = []
    used: list[PciId] = []
    for line in hostpci_lines(config):
        alternatives = _alternatives(vmid, config, line.key, line.host, line.mapping, tokens, where)
        if line.mdev:
            chosen = [device for alternative in alternatives for device in alternative]
        elif len(alternatives) == 1:
            chosen = list(alternatives[0])
            twice = [str(d) for d in chosen if any(_overlap(d, other) for other in used)]
            if twice:
                # qemu-server's choose_hostpci_devices dies on this too.
                raise GuestConfigError(
                    config.guest, f"{line.key}: device {twice[0]} is assigned more than once"
                )
        else:
            chosen = _choose(
                vmid, config.guest, line.mapping or "", alternatives, used, where, running
            )
        used.extend(chosen)
        devices.extend(f"{line.key}={device}" for device in chosen)
        found = [name for device in chosen for name in _tokens_covering(device, tokens)]
        (shared if line.mdev else exclusive).extend(found)
    names = tuple(dict.fromkeys([*exclusive, *shared, *override.tokens]))
    if not names:
        return None
    if exclusive and shared and not running:
        # A claim has one mode: a mediated device needs its GPU on its own driver,
        # a whole device needs vfio-pci.  (A VM that runs so is a holder of both.)
        raise GuestConfigError(
            config.guest,
            f"it has mediated devices on {', '.join(dict.fromkeys(shared))} (a shared "
            f"claim) and passes {', '.join(dict.fromkeys(exclusive))} whole (an exclusive "
            "claim); the arbiter claims in one mode per VM",
            config.path,
        )
    mode = override.mode or (Mode.EXCLUSIVE if exclusive or not shared else Mode.SHARED)
    return VmClaim(
        mode=mode,
        tokens=names,
        preemptible=bool(override.preemptible),
        transient=bool(override.transient),
        stop=override.stop or "shutdown",
        devices=tuple(devices),
    )


def _alternatives(
    vmid: str,
    config: GuestConfig,
    key: str,
    host: tuple[PciId, ...],
    mapping: str | None,
    tokens: Sequence[TokenSpec],
    where: ProxmoxNode,
) -> list[tuple[PciId, ...]]:
    if mapping is None:
        return [host]
    found = where.mappings().get(mapping)
    if found is None:
        raise MappingError(config.guest, mapping, "the cluster has no such PCI mapping")
    entries = found.on_node(where.node)
    if not entries:
        raise MappingError(config.guest, mapping, f"it has no device on node {where.node!r}")
    for entry in entries:
        _check_hardware(config.guest, mapping, entry, tokens)
    return [entry.path for entry in entries]


def _check_hardware(guest: str, mapping: str, entry: MapEntry, tokens: Sequence[TokenSpec]) -> None:
    """qemu-server's assert_valid, where the arbiter knows the device: the vendor and
    device id of each path, the IOMMU group of the first."""
    functions = {f.address: f for token in tokens for f in token.functions}
    for index, device in enumerate(entry.path):
        address = str(device) if device.function is not None else f"{device}.0"
        function = functions.get(address)
        if function is None:
            continue  # not a token's: not the arbiter's to check
        seen = f"{function.vendor}:{function.device}".lower()
        if seen != entry.device_id:
            raise MappingError(
                guest, mapping, f"{address} is {seen} now, the mapping says {entry.device_id}"
            )
        if index == 0 and entry.iommu_group is not None:
            group = function.iommu_group
            if group is not None and str(entry.iommu_group) != str(group):
                raise MappingError(
                    guest,
                    mapping,
                    f"{address} is in IOMMU group {group} now, the mapping says "
                    f"{entry.iommu_group}",
                )


def _choose(
    vmid: str,
    guest: str,
    mapping: str,
    alternatives: list[tuple[PciId, ...]],
    used: list[PciId],
    where: ProxmoxNode,
    running: bool,
) -> list[PciId]:
    """The alternative qemu-server's choose_hostpci_devices takes: the first not used by
    this VM's earlier lines nor reserved by another running VM.  For a VM that runs
    already: the alternative reserved for it (all of them when none is)."""
    reservations = where.reservations()
    if running:
        mine = [
            alternative
            for alternative in alternatives
            if any(
                reservation.vmid == vmid and device.covers(_full(pci))
                for pci, reservation in reservations
                for device in alternative
            )
        ]
        return list(mine[0]) if mine else [d for alternative in alternatives for d in alternative]
    holders = []
    for alternative in alternatives:
        if any(_overlap(device, other) for device in alternative for other in used):
            continue
        holder = in_use_by_others(alternative, reservations, vmid, where.alive)
        if holder is None:
            return list(alternative)
        holders.append(holder)
    raise MappingError(
        guest,
        mapping,
        "every device it has on this node is in use"
        + (f" (by VM {', '.join(sorted(set(holders)))})" if holders else ""),
    )


def _overlap(one: PciId, other: PciId) -> bool:
    """Whether two ids name a function in common (a device without a function names
    all of them)."""
    if one.function is not None:
        return other.covers(str(one))
    if other.function is not None:
        return one.covers(str(other))
    return str(one) == str(other)


def _full(pci: str) -> str:
    return pci if pci.count(":") == 2 else f"0000:{pci}"


def _tokens_covering(device: PciId, tokens: Sequence[TokenSpec]) -> list[str]:
    return [
        token.name
        for token in tokens
        if any(device.covers(function.address) for function in token.functions)
    ]
