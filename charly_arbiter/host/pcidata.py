"""The package's one PCI data file (`data/pci.toml`), and what is derived from it.

Vendor names, class labels, host-critical classes and the device-node
patterns live in the data file; this module reads it once and answers
"what is this class called", "does the host need it" and "which /dev nodes
belong to this function" for `detect`, `doctor` and the holder scan.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from charly_arbiter.core.host import PciFunction
from charly_arbiter.host.kmod import module_name
from charly_arbiter.host.sysfs import Sysfs


@dataclass(frozen=True)
class NodeRule:
    kind: str
    dev: str  # a path under the /dev root, with {name}, {minor} or {group}
    sysfs: str | None = None
    driver: str | None = None
    scope: str = "function"  # or "driver": the driver's own node, shared by its GPUs


@dataclass(frozen=True)
class PciData:
    vendors: dict[str, str]
    classes: dict[str, str]
    critical: dict[str, str]
    nodes: tuple[NodeRule, ...]
    home_drivers: dict[str, tuple[str, ...]]
    driver_modules: dict[str, str]

    def vendor_name(self, vendor: str) -> str:
        return self.vendors.get(vendor, vendor)

    def class_label(self, pci_class: str) -> str:
        return self.classes.get(pci_class[:4]) or self.classes.get(pci_class[:2], "Unknown class")

    def critical_reason(self, pci_class: str) -> str | None:
        return self.critical.get(pci_class[:4]) or self.critical.get(pci_class[:2])

    def module_of(self, driver: str) -> str:
        """The kernel module that registers `driver` (mostly the same name)."""
        return module_name(self.driver_modules.get(driver, driver))

    def default_driver(self, vendor: str, modules: Sequence[str]) -> str | None:
        """The driver a device of `vendor` goes home to, given the modules this kernel
        has for it: the vendor's preferred one, else the first that is not a VFIO
        stub, else None (nothing on this host can take it)."""
        available = [module_name(m) for m in modules]
        for driver in self.home_drivers.get(vendor, ()):
            if self.module_of(driver) in available:
                return driver
        return next((m for m in available if not m.startswith("vfio")), None)


@functools.cache
def pci_data() -> PciData:
    text = resources.files("charly_arbiter").joinpath("data/pci.toml").read_text("utf-8")
    table = tomllib.loads(text)
    return PciData(
        vendors=dict(table["vendors"]),
        classes=dict(table["classes"]),
        critical=dict(table["critical_classes"]),
        nodes=tuple(NodeRule(**rule) for rule in table["nodes"]),
        home_drivers={k: tuple(v) for k, v in table["home_drivers"].items()},
        driver_modules=dict(table["driver_modules"]),
    )


def nvidia_minor(proc_root: Path, address: str) -> str | None:
    """NVIDIA's device minor (the N of /dev/nvidiaN), from the driver's /proc file."""
    information = proc_root / "driver" / "nvidia" / "gpus" / address / "information"
    try:
        text = information.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Device Minor":
            return value.strip()
    return None


def function_nodes(
    sysfs: Sysfs, dev_root: Path, proc_root: Path, function: PciFunction
) -> dict[str, str]:
    """The device nodes of one function that exist now: path -> kind."""
    found: dict[str, str] = {}
    device = sysfs.device(function.address)
    for rule in pci_data().nodes:
        if rule.scope != "function":
            continue
        names: list[dict[str, str]] = []
        if rule.sysfs is not None:
            names = [{"name": match.name} for match in sorted(device.glob(rule.sysfs))]
        elif rule.driver is not None and function.driver == rule.driver:
            minor = nvidia_minor(proc_root, function.address) if "{minor}" in rule.dev else ""
            if minor is not None:
                names = [{"minor": minor, "group": function.iommu_group or ""}]
        for fields in names:
            node = dev_root / rule.dev.format(**{"name": "", "minor": "", "group": "", **fields})
            if node.exists():
                found[str(node)] = rule.kind
    return found


def driver_nodes(dev_root: Path, driver: str) -> dict[str, str]:
    """The nodes `driver` itself has (shared by every device bound to it): path -> kind."""
    found: dict[str, str] = {}
    for rule in pci_data().nodes:
        if rule.scope == "driver" and rule.driver == driver:
            for node in sorted(dev_root.glob(rule.dev)):
                found[str(node)] = rule.kind
    return found
