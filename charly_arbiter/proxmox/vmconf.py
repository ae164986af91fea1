"""Guest configuration files, read the way qemu-server and pve-container read them.

`/etc/pve/qemu-server/VMID.conf` (a VM) and `/etc/pve/lxc/CTID.conf` (a
container) are lines of `key: value` in a main section, followed by sections in
brackets: `[PENDING]` (`[pve:pending]` for containers), `[special:…]` and one
per snapshot.  What a guest runs with is the main section (qemu-server applies
pending changes to it before the `pre-start` hook runs, and a running guest's
pending changes are not in effect), so only the main section is read.  Lines
starting with `#` and `description:` values are the guest's description,
percent-encoded (PVE::Tools::encode_text); `tags:` is a list separated by `;`,
`,` or spaces.  A container's `lxc.*` lines are kept in order.  docs/proxmox.md
names the Proxmox source each rule comes from.

The files are untrusted in the sense that matters here: a user allowed to edit a
VM wrote them.  They are bounded in size; a `hostpciN` value is checked against
qemu-server's own grammar, and anything the arbiter cannot read for certain is
an error that refuses the VM's start (`GuestConfigError`) rather than a guess.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote_to_bytes

from charly_arbiter.core.model import Mode
from charly_arbiter.errors import ArbiterError

log = logging.getLogger(__name__)

# pmxcfs keeps small files; a VM's configuration is a few KiB (its description at
# most 8 KiB).  Larger is refused, never read in part.
MAX_CONFIG_BYTES = 1 << 20
HOSTPCI_SLOTS = 16  # hostpci0 .. hostpci15 (qemu-server's $MAX_HOSTPCI_DEVICES)

_SECTION = re.compile(r"\[[^\]]*\]\s*")
_VM_KEY = re.compile(r"([a-z][a-z_\-]*\d*):\s*(.+?)\s*")
_CT_KEY = re.compile(r"([a-z][a-z_]*\d*):\s*(.+?)\s*")
_LXC_KEY = re.compile(r"(lxc\.[a-z0-9_\-\.]+)(?::|\s*=)\s*(.*?)\s*")
_HOSTPCI_KEY = re.compile(r"hostpci(\d+)")
_DEV_KEY = re.compile(r"dev\d+")

# qemu-server's PCI id (PVE::QemuServer::PCI, $PCIRE): an optional domain, bus and
# device, and an optional function; lower-case hex only.
_PCI_ID = re.compile(
    r"(?:(?P<domain>[a-f0-9]{4,}):)?(?P<bus>[a-f0-9]{2}):(?P<slot>[a-f0-9]{2})"
    r"(?:\.(?P<function>[a-f0-9]))?"
)
_CONFIG_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # pve-configid (mapping ids)
_BOOLEANS = {"1": True, "on": True, "yes": True, "true": True}
_BOOLEANS |= {"0": False, "off": False, "no": False, "false": False}


def _boolean(value: str) -> bool | None:
    return _BOOLEANS.get(value.lower())


# hostpciN options other than host and mapping (qemu-server's $hostpci_fmt), each
# with the check qemu-server makes.  None of them changes which device is passed.
HOSTPCI_OPTIONS: dict[str, re.Pattern[str] | None] = {
    "rombar": None,  # None: a boolean
    "pcie": None,
    "x-vga": None,
    "legacy-igd": None,
    "romfile": re.compile(r"[^,;]+"),
    "mdev": re.compile(r"[^/.:]+"),
    "vendor-id": re.compile(r"0x[0-9a-fA-F]{4}"),
    "device-id": re.compile(r"0x[0-9a-fA-F]{4}"),
    "sub-vendor-id": re.compile(r"0x[0-9a-fA-F]{4}"),
    "sub-device-id": re.compile(r"0x[0-9a-fA-F]{4}"),
}

# The override, in a guest's description or tags (docs/proxmox.md).
DESCRIPTION_MARKER = "charly-arbiter:"
TAG_PREFIX = "charly-"
TAG_FLAGS = {
    "charly-exclusive": ("mode", Mode.EXCLUSIVE),
    "charly-shared": ("mode", Mode.SHARED),
    "charly-preemptible": ("preemptible", True),
    "charly-transient": ("transient", True),
}
STOP_METHODS = ("shutdown", "stop")
OVERRIDE_KEYS = ("mode", "tokens", "preemptible", "transient", "stop")
_TOKEN_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class GuestConfigError(ArbiterError):
    """A guest's configuration the arbiter cannot read for certain."""

    def __init__(self, guest: str, why: str, path: Path | None = None) -> None:
        where = f"`qm set`/`pct set` or {path}" if path else "`qm set`/`pct set`"
        super().__init__(
            f"the configuration of {guest} was not accepted: {why}",
            hint=f"fix it with {where} (docs/proxmox.md has the syntax)",
        )
        self.why = why


@dataclass(frozen=True)
class GuestConfig:
    """The main section of a guest's configuration."""

    guest: str  # proxmox:VMID or lxc:CTID, for messages
    settings: tuple[tuple[str, str], ...] = ()  # in file order; a later key wins
    description: str = ""
    lxc: tuple[tuple[str, str], ...] = ()  # a container's raw lxc.* lines, in order
    path: Path | None = None

    def get(self, key: str) -> str | None:
        found = None
        for name, value in self.settings:
            if name == key:
                found = value
        return found

    @property
    def tags(self) -> tuple[str, ...]:
        """Tags split as PVE::Tools::split_list splits them."""
        text = self.get("tags") or ""
        return tuple(tag for tag in re.split(r"[\s,;]+", text) if tag)


# -- reading ---------------------------------------------------------------------------


def read_config_file(path: Path, guest: str) -> bytes | None:
    """The file's bytes; None when there is none.  Anything but a regular file of at
    most MAX_CONFIG_BYTES is an error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise GuestConfigError(guest, f"{path} cannot be read ({error.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise GuestConfigError(guest, f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise GuestConfigError(guest, f"{path} cannot be read ({error.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise GuestConfigError(guest, f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    return data


def decode_text(text: str) -> str:
    """PVE::Tools::decode_text: percent-decoding, then UTF-8."""
    return unquote_to_bytes(text).decode("utf-8", "replace")


def parse_vm_config(data: bytes, guest: str, path: Path | None = None) -> GuestConfig:
    return _parse(data, guest, path, container=False)


def parse_ct_config(data: bytes, guest: str, path: Path | None = None) -> GuestConfig:
    return _parse(data, guest, path, container=True)


def _parse(data: bytes, guest: str, path: Path | None, *, container: bool) -> GuestConfig:
    """The main section (everything before the first `[…]` line), as qemu-server's
    parse_vm_config and pve-container's parse_pct_config split it."""
    text = data.decode("utf-8", "replace")
    settings: list[tuple[str, str]] = []
    raw: list[tuple[str, str]] = []
    description: list[str] = []
    key_pattern = _CT_KEY if container else _VM_KEY
    for line in text.split("\n"):
        if not line.strip():
            continue
        if _SECTION.fullmatch(line):
            break  # pending, special and snapshot sections: not what the guest runs with
        if line.startswith("#"):
            description.append(decode_text(line[1:]) + "\n")
            continue
        lxc = _LXC_KEY.fullmatch(line) if container else None
        if lxc is not None:
            raw.append((lxc.group(1), lxc.group(2)))
            continue
        if line.startswith("description:"):
            value = line.partition(":")[2].strip()
            if value:
                description.append(decode_text(value))
            continue
        match = key_pattern.fullmatch(line)
        if match is None:
            log.warning(
                "%s: a configuration line is ignored, as Proxmox ignores it: %r", guest, line
            )
            continue
        settings.append((match.group(1), match.group(2)))
    return GuestConfig(guest, tuple(settings), "".join(description).rstrip(), tuple(raw), path)


# -- hostpciN ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PciId:
    """A PCI id as a hostpci line or a mapping writes it: without a function, every
    function of the device; without a domain, domain 0000."""

    domain: str
    bus: str
    slot: str
    function: str | None = None

    def __str__(self) -> str:
        base = f"{self.domain}:{self.bus}:{self.slot}"
        return f"{base}.{self.function}" if self.function is not None else base

    def covers(self, address: str) -> bool:
        """Whether the function at `address` is one this id passes through (the
        prefix match of PVE::SysFSTools::lspci)."""
        if self.function is not None:
            return address == str(self)
        return address.startswith(f"{self.domain}:{self.bus}:{self.slot}.")


def parse_pci_id(text: str, *, require_domain: bool = False) -> PciId:
    """One id; raises ValueError saying why it is not one."""
    match = _PCI_ID.fullmatch(text)
    if match is None or (require_domain and match.group("domain") is None):
        form = (
            "DOMAIN:BUS:DEVICE[.FUNCTION]" if require_domain else "[DOMAIN:]BUS:DEVICE[.FUNCTION]"
        )
        raise ValueError(f"{text!r} is not a PCI id ({form}, lower-case hex)")
    domain = match.group("domain") or "0000"
    if len(domain) > 8:
        raise ValueError(f"{text!r} has a PCI domain longer than 8 hex digits")
    if int(match.group("slot"), 16) > 0x1F:
        raise ValueError(f"{text!r} has a device number above 1f")
    function = match.group("function")
    if function is not None and int(function, 16) > 7:
        raise ValueError(f"{text!r} has a function above 7")
    return PciId(domain, match.group("bus"), match.group("slot"), function)


@dataclass(frozen=True)
class HostPci:
    """One hostpciN line."""

    key: str
    host: tuple[PciId, ...] = ()  # host=ID[;ID...]: the devices, passed together
    mapping: str | None = None  # mapping=ID: the cluster's PCI mapping
    options: tuple[tuple[str, str], ...] = ()
    unknown: tuple[str, ...] = field(default=(), compare=False)

    def option(self, name: str) -> str | None:
        return dict(self.options).get(name)

    @property
    def mdev(self) -> str | None:
        """The mediated device type: the device stays on its own driver."""
        return self.option("mdev")


def parse_hostpci(key: str, value: str) -> HostPci:
    """A hostpciN value in qemu-server's grammar (PVE::JSONSchema property string over
    $hostpci_fmt); raises ValueError saying what is wrong.  An option this version
    does not know is kept aside (and logged by the caller): it cannot change which
    device is passed through, and a newer qemu-server may have added it."""
    parts: dict[str, str] = {}
    unknown = []
    for part in value.split(","):
        if not part.strip():
            continue
        if "=" in part:
            name, _, option = part.partition("=")
            if not name or not option:
                raise ValueError(f"{part!r} is not KEY=VALUE")
        else:
            name, option = "host", part  # the default key
        if name in parts:
            raise ValueError(f"{name!r} is given twice")
        parts[name] = option
    host, mapping = parts.pop("host", None), parts.pop("mapping", None)
    if host is not None and mapping is not None:
        raise ValueError("it sets both host and mapping")
    if host is None and mapping is None:
        raise ValueError("it sets neither host nor mapping")
    if mapping is not None and _CONFIG_ID.fullmatch(mapping) is None:
        raise ValueError(f"mapping {mapping!r} is not a mapping id")
    ids = tuple(parse_pci_id(item) for item in host.split(";")) if host is not None else ()
    options = []
    for name, option in parts.items():
        if name not in HOSTPCI_OPTIONS:
            unknown.append(name)
            continue
        check = HOSTPCI_OPTIONS[name]
        if check is None:
            flag = _boolean(option)
            if flag is None:
                raise ValueError(f"{name}={option!r} is not a boolean")
            option = "1" if flag else "0"
        elif check.fullmatch(option) is None:
            raise ValueError(f"{name}={option!r} is not valid")
        options.append((name, option))
    if dict(options).get("mdev") and len(ids) > 1:
        raise ValueError("a mediated device cannot be made of several devices")
    return HostPci(key, ids, mapping, tuple(sorted(options)), tuple(unknown))


def hostpci_lines(config: GuestConfig) -> list[HostPci]:
    """Every hostpciN of the main section (N below 16, as qemu-server reads them)."""
    found: dict[str, HostPci] = {}
    for key, value in config.settings:
        match = _HOSTPCI_KEY.fullmatch(key)
        if match is None:
            continue
        if int(match.group(1)) >= HOSTPCI_SLOTS or match.group(1) != str(int(match.group(1))):
            raise GuestConfigError(
                config.guest, f"{key} is not one of hostpci0 to hostpci15", config.path
            )
        if key in found:
            raise GuestConfigError(config.guest, f"{key} is set twice", config.path)
        try:
            found[key] = parse_hostpci(key, value)
        except ValueError as error:
            raise GuestConfigError(config.guest, f"{key}: {error}", config.path) from None
        if found[key].unknown:
            log.warning(
                "%s: %s: options unknown to this version ignored: %s",
                config.guest,
                key,
                ", ".join(found[key].unknown),
            )
    return [found[key] for key in sorted(found, key=lambda k: int(k[len("hostpci") :]))]


# -- the override -----------------------------------------------------------------------


@dataclass(frozen=True)
class Override:
    """What the description line and the tags say about a guest's claim."""

    mode: Mode | None = None
    tokens: tuple[str, ...] = ()
    preemptible: bool | None = None
    transient: bool | None = None
    stop: str | None = None
    present: bool = False


def parse_override(config: GuestConfig) -> Override:
    """The `charly-arbiter: KEY=VALUE …` description line and the `charly-…` tags;
    raises GuestConfigError for anything it does not understand, or a contradiction."""
    values: dict[str, object] = {}
    lines = [
        line.strip()
        for line in config.description.splitlines()
        if line.strip().lower().startswith(DESCRIPTION_MARKER)
    ]
    if len(lines) > 1:
        raise _override_error(
            config, f"the description has {len(lines)} {DESCRIPTION_MARKER} lines"
        )
    for line in lines:
        for word in line[len(DESCRIPTION_MARKER) :].split():
            name, sep, text = word.partition("=")
            if not sep or name not in OVERRIDE_KEYS:
                raise _override_error(
                    config, f"{word!r} is not one of {', '.join(k + '=' for k in OVERRIDE_KEYS)}"
                )
            if name in values:
                raise _override_error(config, f"{name} is given twice")
            values[name] = _override_value(config, name, text)
    for tag in config.tags:
        lowered = tag.lower()
        if not lowered.startswith(TAG_PREFIX):
            continue
        if lowered not in TAG_FLAGS:
            raise _override_error(
                config, f"tag {tag!r} is not one of {', '.join(sorted(TAG_FLAGS))}"
            )
        name, value = TAG_FLAGS[lowered]
        if name in values and values[name] != value:
            raise _override_error(config, f"tag {tag!r} contradicts {name}={values[name]}")
        values[name] = value
    mode, tokens = values.get("mode"), values.get("tokens", ())
    return Override(
        mode=mode if isinstance(mode, Mode) else None,
        tokens=tuple(str(token) for token in tokens) if isinstance(tokens, tuple) else (),
        preemptible=_flag(values.get("preemptible")),
        transient=_flag(values.get("transient")),
        stop=str(values["stop"]) if "stop" in values else None,
        present=bool(values),
    )


def _flag(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _override_value(config: GuestConfig, name: str, text: str) -> object:
    if name == "mode":
        if text not in (Mode.EXCLUSIVE, Mode.SHARED):
            raise _override_error(config, f"mode={text!r} is not exclusive or shared")
        return Mode(text)
    if name == "tokens":
        tokens = tuple(dict.fromkeys(item for item in text.split(",") if item))
        bad = [token for token in tokens if _TOKEN_NAME.fullmatch(token) is None]
        if not tokens or bad:
            raise _override_error(config, f"tokens={text!r} is not a list of token names")
        return tokens
    if name == "stop":
        if text not in STOP_METHODS:
            raise _override_error(config, f"stop={text!r} is not one of {', '.join(STOP_METHODS)}")
        return text
    flag = _boolean(text)
    if flag is None:
        raise _override_error(config, f"{name}={text!r} is not yes or no")
    return flag


def _override_error(config: GuestConfig, why: str) -> GuestConfigError:
    return GuestConfigError(config.guest, f"its charly-arbiter override: {why}", config.path)


# -- a container's devices ---------------------------------------------------------------


@dataclass(frozen=True)
class ContainerDevices:
    """Where a container's configuration gives it host device nodes."""

    paths: tuple[str, ...] = ()  # /dev/… paths: devN, and lxc.mount.entry sources
    numbers: tuple[tuple[int, int | None], ...] = ()  # c MAJOR:MINOR allow rules (None: *)


def container_devices(config: GuestConfig) -> ContainerDevices:
    """devN paths (pve-container's $dev_desc), the /dev sources of lxc.mount.entry
    lines (fstab fields), and the character devices lxc.cgroup2.devices.allow (or
    cgroup v1's lxc.cgroup.devices.allow) names by major.  A rule that allows every
    device (`a`, `c *:* rwm`) names no GPU in particular and is not counted."""
    paths: list[str] = []
    numbers: list[tuple[int, int | None]] = []
    for key, value in config.settings:
        if _DEV_KEY.fullmatch(key):
            path = _dev_path(value)
            if path is None:
                log.warning("%s: %s: %r is not a device path; ignored", config.guest, key, value)
            else:
                paths.append(path)
    for key, value in config.lxc:
        if key == "lxc.mount.entry":
            fields = value.split()
            source = _fstab_unescape(fields[0]) if fields else ""
            if _is_dev_path(source):
                paths.append(source)
        elif key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            rule = _allow_rule(value)
            if rule is not None:
                numbers.append(rule)
    return ContainerDevices(tuple(dict.fromkeys(paths)), tuple(dict.fromkeys(numbers)))


def _dev_path(value: str) -> str | None:
    """The path of a devN value (`[path=]/dev/…[,mode=…][,uid=…][,gid=…]`)."""
    for part in value.split(","):
        name, sep, rest = part.partition("=")
        candidate = rest if sep and name == "path" else (part if not sep else None)
        if candidate is not None:
            return candidate if _is_dev_path(candidate) else None
    return None


def _is_dev_path(path: str) -> bool:
    """pve-container's check: under /dev/, without `.` or `..` components."""
    return path.startswith("/dev/") and not any(p in (".", "..") for p in path.split("/"))


def _fstab_unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _allow_rule(value: str) -> tuple[int, int | None] | None:
    fields = value.split()
    if len(fields) < 2 or fields[0] != "c":
        return None
    major, sep, minor = fields[1].partition(":")
    if not sep or not major.isdigit() or not (minor.isdigit() or minor == "*"):
        return None
    return int(major), int(minor) if minor.isdigit() else None
