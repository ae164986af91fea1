"""This kernel's module index: which modules exist, and which would bind a device.

`modules.alias` is what udev and modprobe use to find the module for a device's
`modalias` (`pci:v000010DEd00002684sv…bc03sc00i00`); reading it here answers
"which driver could take this GPU back from vfio-pci" without loading anything.
`modules.dep` and `modules.builtin` say whether a module exists at all.
Everything is read once per process, and only when asked: only a GPU found on
vfio-pci with no known home driver needs it.
"""

from __future__ import annotations

import os
import re
from fnmatch import fnmatchcase
from pathlib import Path

MODULES_ROOT = Path("/lib/modules")

# A PCI modalias and the aliases that match it, field by field: vendor, device,
# subsystem vendor and device, base class, subclass, programming interface.
_FIELDS = re.compile(r"pci:v(.+?)d(.+?)sv(.+?)sd(.+?)bc(.+?)sc(.+?)i(.+)")
Fields = tuple[str, ...]


def module_name(name: str) -> str:
    """Module names are spelled with - or _ alike; the index uses _."""
    return name.replace("-", "_")


class KernelModules:
    def __init__(self, modules_root: Path = MODULES_ROOT, release: str | None = None) -> None:
        self.directory = modules_root / (release or os.uname().release)
        self._aliases: dict[str, list[tuple[Fields, str]]] | None = None
        self._names: frozenset[str] | None = None

    def has(self, module: str) -> bool:
        """Whether the module is built in or installed for this kernel."""
        return module_name(module) in self._known()

    def matching(self, modalias: str) -> list[str]:
        """The modules whose PCI aliases match `modalias`, in the index's order."""
        device = _fields(modalias.lower())
        if device is None:
            return []
        found: list[str] = []
        for prefix in (device[0], "*"):
            for pattern, module in self._pci_aliases().get(prefix, ()):
                if module not in found and all(map(_field_matches, pattern, device)):
                    found.append(module)
        return found

    def _pci_aliases(self) -> dict[str, list[tuple[Fields, str]]]:
        """`alias pci:… module` lines as fields, grouped by vendor (`*` for aliases that
        match every vendor, such as class matches)."""
        if self._aliases is not None:
            return self._aliases
        grouped: dict[str, list[tuple[Fields, str]]] = {}
        for line in self._read("modules.alias").splitlines():
            parts = line.split()
            if len(parts) != 3 or parts[0] != "alias" or not parts[1].startswith("pci:v"):
                continue
            pattern = _fields(parts[1].lower())
            if pattern is not None:
                grouped.setdefault(pattern[0], []).append((pattern, module_name(parts[2])))
        self._aliases = grouped
        return grouped

    def _known(self) -> frozenset[str]:
        if self._names is not None:
            return self._names
        names = set()
        for listing in ("modules.dep", "modules.builtin"):
            for line in self._read(listing).splitlines():
                path = line.partition(":")[0].strip()
                if path:
                    names.add(module_name(os.path.basename(path).partition(".ko")[0]))
        self._names = frozenset(names)
        return self._names

    def _read(self, name: str) -> str:
        try:
            return (self.directory / name).read_text(errors="replace")
        except OSError:
            return ""


def _fields(alias: str) -> Fields | None:
    found = _FIELDS.fullmatch(alias)
    return found.groups() if found else None


def _field_matches(pattern: str, value: str) -> bool:
    if pattern == "*" or pattern == value:
        return True
    return "*" in pattern and fnmatchcase(value, pattern)
