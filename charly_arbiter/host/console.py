"""The host's console and display on a GPU: what keeps it from leaving, and freeing it.

A GPU can be the host's screen in three ways: the firmware's boot display
(`boot_vga`, often with a platform framebuffer such as efifb or simpledrm
sitting on its memory), the kernel's framebuffer console (fbcon on one of its
`/sys/class/graphics/fbN`), and a display server with its DRM nodes open.
Passed through, the host loses that screen; a platform framebuffer on its
memory even keeps vfio-pci from claiming it.  So an exclusive claim on such a
GPU is refused with what runs on it, unless the configuration says
`console = "release"`: then the framebuffer console is unbound from it (and
the boot framebuffer released) before the switch, and the console bound again
when it comes home.  Display servers are holders like any other (list the
display manager as one to have it stopped and started again).

fbcon is one console for every framebuffer; which framebuffer it draws on is
not in sysfs, so "the console runs on this GPU" means: fbcon is bound and the
GPU has a framebuffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.core.host import TokenSpec
from charly_arbiter.host.blocking import TimedOut, bounded
from charly_arbiter.host.pcidata import function_nodes
from charly_arbiter.host.procscan import program_name, scan
from charly_arbiter.host.sysfs import Sysfs

log = logging.getLogger(__name__)

FRAMEBUFFER_CONSOLE = "frame buffer device"  # the name fbcon's vtconsole has
PLATFORM_FRAMEBUFFERS = ("efi-framebuffer", "simple-framebuffer", "vesa-framebuffer")
DISPLAY_SERVERS = frozenset(
    {
        "Xorg",
        "X",
        "Xwayland",
        "gnome-shell",
        "kwin_wayland",
        "kwin_x11",
        "sway",
        "weston",
        "gdm",
        "gdm-x-session",
        "sddm",
        "lightdm",
        "cage",
        "gamescope",
    }
)


@dataclass(frozen=True)
class Display:
    """What of the host's screen runs on one GPU."""

    boot_vga: tuple[str, ...]  # its functions the firmware booted on
    framebuffers: tuple[str, ...]  # fb0, ...
    consoles: tuple[str, ...]  # bound framebuffer consoles (vtcon1)
    servers: tuple[str, ...] = ()  # "Xorg (pid 812)"

    @property
    def drives_it(self) -> bool:
        return bool(self.boot_vga or (self.framebuffers and self.consoles) or self.servers)

    def describe(self) -> str:
        parts = []
        if self.boot_vga:
            parts.append(f"it is the boot display ({', '.join(self.boot_vga)} has boot_vga)")
        if self.framebuffers and self.consoles:
            parts.append(f"the text console runs on it ({', '.join(self.framebuffers)})")
        if self.servers:
            parts.append(f"{', '.join(self.servers)} draw on it")
        return "; ".join(parts)


class Console:
    def __init__(
        self,
        sysfs: Sysfs,
        proc_root: Path,
        dev_root: Path,
        write: Callable[[Path, str], None],
        timeout: float,
    ) -> None:
        self.sysfs = sysfs
        self.proc_root = proc_root
        self.dev_root = dev_root
        self.write = write
        self.timeout = timeout
        self.graphics = sysfs.root / "class" / "graphics"
        self.vtconsoles = sysfs.root / "class" / "vtconsole"

    def of(self, token: TokenSpec, *, servers: bool = False) -> Display:
        """What runs on the token's GPU (`servers`: also scan /proc for display servers,
        only worth it once something else already says it is a display)."""
        addresses = [f.address for f in token.functions]
        boot = tuple(a for a in addresses if self.sysfs.attribute(a, "boot_vga") == "1")
        framebuffers = tuple(self._framebuffers(addresses))
        display = Display(boot, framebuffers, tuple(self._bound_consoles()))
        if servers and display.drives_it:
            display = Display(boot, framebuffers, display.consoles, self._servers(token))
        return display

    def release(self, token: TokenSpec) -> None:
        """Take the console (and the boot framebuffer) off the GPU before it leaves."""
        display = self.of(token)
        if display.framebuffers:
            for console in display.consoles:
                log.info("%s: unbinding the framebuffer console %s", token.name, console)
                self._write(self.vtconsoles / console / "bind", "0\n")
        if display.boot_vga:
            for driver in PLATFORM_FRAMEBUFFERS:
                directory = self.sysfs.root / "bus" / "platform" / "drivers" / driver
                for device in sorted(directory.glob(f"{driver}.*")):
                    log.info("%s: releasing the boot framebuffer %s", token.name, device.name)
                    self._write(directory / "unbind", device.name)

    def restore(self, token: TokenSpec) -> None:
        """Give the console back once the GPU is home and has a framebuffer again."""
        if not self._framebuffers([f.address for f in token.functions]):
            return
        for console in self._framebuffer_consoles():
            if self._read(self.vtconsoles / console / "bind") == "0":
                log.info("%s: binding the framebuffer console %s again", token.name, console)
                self._write(self.vtconsoles / console / "bind", "1\n")

    def _framebuffers(self, addresses: Sequence[str]) -> list[str]:
        if not self.graphics.is_dir():
            return []
        wanted = {str(self.sysfs.device(a).resolve()) for a in addresses}
        return sorted(
            entry.name
            for entry in self.graphics.iterdir()
            if entry.name.startswith("fb")
            and entry.name[2:].isdigit()
            and str((entry / "device").resolve()) in wanted
        )

    def _framebuffer_consoles(self) -> list[str]:
        if not self.vtconsoles.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.vtconsoles.iterdir()
            if FRAMEBUFFER_CONSOLE in self._read(entry / "name")
        )

    def _bound_consoles(self) -> list[str]:
        return [
            c
            for c in self._framebuffer_consoles()
            if self._read(self.vtconsoles / c / "bind") == "1"
        ]

    def _servers(self, token: TokenSpec) -> tuple[str, ...]:
        nodes: set[str] = set()
        for function in token.functions:
            for node, kind in function_nodes(
                self.sysfs, self.dev_root, self.proc_root, function
            ).items():
                if kind.startswith("drm"):
                    nodes.add(node)
        found = []
        for opened in scan(self.proc_root, nodes):
            program = program_name(self.proc_root, opened.pid)
            if program in DISPLAY_SERVERS:
                found.append(f"{program} (pid {opened.pid})")
        return tuple(dict.fromkeys(found))

    def _write(self, path: Path, text: str) -> None:
        try:
            bounded(lambda: self.write(path, text), self.timeout, f"sysfs {path}")
        except TimedOut:
            log.error("writing %s did not return within %g s", path, self.timeout)
        except OSError as error:
            log.warning("could not write %s: %s", path, error.strerror or error)

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text().strip()
        except OSError:
            return ""
