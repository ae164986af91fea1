"""`/etc/charly-arbiter/arbiter.toml`: read with tomllib, validated with clear errors.

libvirt runs its hooks with a minimal environment, so the configuration file
is how the hook finds the state directory, the host and the libvirt URI.
Command-line options and environment variables override the file.

A simulated host selected on the command line or in the environment
(`--host sim:DIR`, CHARLY_ARBITER_HOST) with no configuration file named is
self-contained: its configuration is DIR/arbiter.toml (which `sim init` writes)
and its state DIR/state, so that trying the tool never reads this machine's
/etc/charly-arbiter nor writes its /var/lib/charly-arbiter.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from charly_arbiter.core.model import (
    Claimant,
    ConsolePolicy,
    HolderKind,
    Preemption,
    ProcessPolicy,
    ScreenPolicy,
    SleepPolicy,
)
from charly_arbiter.core.pci import parse_address
from charly_arbiter.errors import ArbiterError, ConfigError, cli_command

C = TypeVar("C", bound=StrEnum)

DEFAULT_CONFIG = Path("/etc/charly-arbiter/arbiter.toml")
DEFAULT_STATE_DIR = Path("/var/lib/charly-arbiter")
DEFAULT_LIBVIRT_URI = "qemu:///system"
ENV_CONFIG = "CHARLY_ARBITER_CONFIG"
ENV_STATE_DIR = "CHARLY_ARBITER_STATE_DIR"
ENV_HOST = "CHARLY_ARBITER_HOST"

# The kinds a `[[holders]]` entry may have (the others find their holders themselves).
LISTED_KINDS = (HolderKind.SYSTEMD, HolderKind.CONTAINER, HolderKind.LIBVIRT)
# `charly-arbiter attach` records each unit it attached in a file of its own here,
# beside arbiter.toml; they are read as holders too.
ATTACHED_DIR = "attached.d"
HOLDER_KEYS = {"kind", "name", "tokens", "preemptible", "stop", "runtime", "drain", "ready"}
ATTACHED_KEYS = {"mode", "dropin"}
# A CDI device name, `vendor.com/class=name` (the CDI spec's grammar, a little stricter).
_CDI_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*=[A-Za-z0-9_.:-]+")


@dataclass(frozen=True)
class Timeouts:
    lock_wait: float = 10.0
    holder_stop: float = 60.0
    holder_start: float = 60.0
    driver_switch: float = 15.0
    libvirt_call: float = 30.0
    # How long a fresh lease may have a claimant that does not run yet (a VM
    # between its prepare hook and its start) before it counts as stranded.
    claim_grace: float = 60.0
    # How long a claim waits for an operation under way that will let it through
    # (its own previous lease being released: a VM destroyed and started at once).
    claim_wait: float = 30.0
    # A holder's `drain` command, and the wait for it to let go of the GPU.
    holder_drain: float = 30.0
    # How long a release waits for a holder's `ready` command to succeed.
    holder_ready: float = 120.0
    # `screen = "release"`: how long the people in a graphical session have, once told
    # why, before it ends; and how long the display manager has, started again, to be
    # active with a process holding the GPU's card before it counts as failed.
    screen_grace: float = 5.0
    screen_back: float = 60.0


MAX_SECONDS = 86400.0  # no timeout is longer than a day
# Directories that must never become the state directory: the ledger, its lock
# and the history would be written among the system's own files.
SYSTEM_DIRS = frozenset(
    Path(p)
    for p in (
        "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media",
        "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr",  # noqa: S108
        "/usr/bin", "/usr/lib", "/usr/local", "/usr/sbin", "/usr/share", "/var", "/var/lib",
        "/var/log", "/var/tmp", "/var/cache", "/var/run",  # noqa: S108
    )
)  # fmt: skip


@dataclass(frozen=True)
class TokenConfig:
    name: str
    address: str
    home_driver: str | None = None
    cdi: bool = True
    console: ConsolePolicy | None = None  # None: the top-level `console`
    screen: ScreenPolicy | None = None  # None: the top-level `screen`
    # CDI device names (`nvidia.com/gpu=0`) that stand for this token in a
    # container's annotations (the OCI hook claims the token for them).
    cdi_devices: tuple[str, ...] = ()
    # An SR-IOV physical function's VF count, set at boot by the reconcile unit
    # (`charly-arbiter vfs --configured`): the kernel forgets it on every reboot.
    vfs: int | None = None
    # An NVIDIA vGPU virtual function's type (ID or name, as creatable_vgpu_types lists
    # it), set when a VM claims it and cleared when it is released.
    vgpu_type: str | None = None


@dataclass(frozen=True)
class HolderConfig:
    """A holder the host cannot discover by itself (a unit or container using a token).

    `drain` runs before the holder is stopped (it unloads models, finishes
    requests); with `stop = "drain"` the holder is not stopped at all, only
    drained, and must have let go of the GPU's device nodes before the switch.
    `ready` runs after it is started again (or, drained, after the GPU is back),
    until it succeeds: a release waits for it.
    """

    ref: Claimant
    tokens: tuple[str, ...]
    preemptible: bool = False
    stop: str = "stop"  # libvirt: "shutdown" or "managedsave"; others: "stop" or "drain"
    runtime: str = "podman"  # containers only
    drain: tuple[str, ...] = ()  # an argv, its program an absolute path
    ready: tuple[str, ...] = ()
    attached: Path | None = None  # the attached.d file that records it (`attach`)
    mode: str = "shared"  # attached units: how their drop-in claims
    dropin: Path | None = None  # attached units: the drop-in `attach` wrote

    def __post_init__(self) -> None:
        object.__setattr__(self, "ref", Claimant.parse(self.ref))

    @property
    def drains_only(self) -> bool:
        """Drained in place of a stop: it keeps running without the GPU."""
        return self.stop == "drain"


@dataclass(frozen=True)
class ProxmoxConfig:
    """Where a Proxmox VE host keeps what the hookscript reads (`[proxmox]`): the
    cluster file system, qemu-server's run directory (its PCI reservations) and
    lock directory (a VM's configuration lock), the `qm` and `pct` programs, and
    this node's name (the PCI mapping file has an entry per node).  The defaults
    are Proxmox's own; tests point them elsewhere."""

    config_dir: Path = Path("/etc/pve")
    run_dir: Path = Path("/run/qemu-server")
    lock_dir: Path = Path("/var/lock/qemu-server")  # qemu-server's lock-VMID.conf flocks
    qm: str = "/usr/sbin/qm"
    pct: str = "/usr/sbin/pct"
    node: str = ""  # "": this host's name, as Proxmox's nodename() takes it
    preemption: Preemption = Preemption.STOP

    @property
    def node_name(self) -> str:
        return self.node or os.uname().nodename.split(".", 1)[0]


PROXMOX_KEYS = {"config_dir", "run_dir", "lock_dir", "qm", "pct", "node", "preemption"}
_NODE_NAME = re.compile(r"[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?")


@dataclass(frozen=True)
class Config:
    path: Path | None = None
    state_dir: Path = DEFAULT_STATE_DIR
    host: str = "local"
    libvirt_uri: str = DEFAULT_LIBVIRT_URI
    libvirt_preemption: Preemption = Preemption.STOP
    process_policy: ProcessPolicy = ProcessPolicy.REFUSE
    console: ConsolePolicy = ConsolePolicy.REFUSE
    screen: ScreenPolicy = ScreenPolicy.REFUSE
    sleep: SleepPolicy = SleepPolicy.BLOCK
    hook_log: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    tokens: tuple[TokenConfig, ...] = ()
    holders: tuple[HolderConfig, ...] = ()  # arbiter.toml's, then attached.d's
    # Where a configuration without a file keeps attached.d (a simulated host's DIR).
    home: Path | None = None
    proxmox: ProxmoxConfig = field(default_factory=ProxmoxConfig)

    @property
    def attached_dir(self) -> Path:
        """Where `attach` records units: beside the configuration file."""
        if self.path is None and self.home is not None:
            return self.home / ATTACHED_DIR
        return (self.path or DEFAULT_CONFIG).parent / ATTACHED_DIR

    def holder(self, ref: str) -> HolderConfig | None:
        return next((holder for holder in self.holders if holder.ref == ref), None)


def load_config(
    path: Path | None = None,
    *,
    state_dir: Path | None = None,
    host: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Config:
    """Read the file (default path: absent is fine), then apply env and option overrides."""
    explicit = path is not None or ENV_CONFIG in environ
    if host is None and ENV_HOST in environ:
        host = environ[ENV_HOST]
    host = _absolute_sim(host)
    simulated = sim_directory(host) if not explicit else None
    if explicit:
        config_path = path or Path(environ[ENV_CONFIG])
    elif simulated is not None:
        config_path = simulated / "arbiter.toml"  # the simulated host's own
    else:
        config_path = DEFAULT_CONFIG
    if config_path.exists() or explicit:
        table = _read_table(config_path)
        config = _parse(config_path, table)
        if simulated is not None and "state_dir" not in table:
            config = replace(config, state_dir=simulated / "state")
    elif simulated is not None:
        config = Config(state_dir=simulated / "state", home=simulated)
    else:
        config = Config()
    config = _with_attached(config)
    if ENV_STATE_DIR in environ:
        config = replace(config, state_dir=Path(environ[ENV_STATE_DIR]))
    if state_dir is not None:
        config = replace(config, state_dir=state_dir)
    if host is not None:
        config = replace(config, host=host)
    _check_host_spec(config)
    _check_state_dir(config)
    return config


def _read_table(path: Path) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as error:
        raise ConfigError(path, None, f"cannot be read ({error.strerror})") from error
    try:
        _check_config_file(path, os.fstat(fd))
        with os.fdopen(fd, "rb", closefd=False) as handle:
            text = handle.read(MAX_CONFIG_BYTES + 1).decode("utf-8")
    except OSError as error:
        raise ConfigError(path, None, f"cannot be read ({error.strerror})") from error
    except UnicodeDecodeError:
        raise ConfigError(path, None, "is not UTF-8 text") from None
    finally:
        os.close(fd)
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(path, None, f"is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError) as error:
        raise ConfigError(path, None, f"is not valid TOML: {error}") from None


MAX_CONFIG_BYTES = 1 << 20


def _check_config_file(path: Path, info: os.stat_result) -> None:
    """The configuration decides what root does to the host's GPUs: it must be a
    regular file that nobody but root can change."""
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(path, None, "is not a regular file")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            path, None, f"is group- or world-writable (mode {stat.S_IMODE(info.st_mode):o})"
        )
    if os.geteuid() == 0 and info.st_uid != 0:
        raise ConfigError(path, None, f"is owned by uid {info.st_uid}, not root")


def _check_state_dir(config: Config) -> None:
    where = config.path or "--state-dir"
    directory = config.state_dir
    if not directory.is_absolute():
        raise ConfigError(where, "state_dir", f"{str(directory)!r} is not an absolute path")
    if ".." in directory.parts or str(directory) != os.path.normpath(directory):
        raise ConfigError(where, "state_dir", f"{str(directory)!r} is not a normalised path")
    if directory in SYSTEM_DIRS:
        raise ConfigError(
            where,
            "state_dir",
            f"{directory} is a system directory; use a directory of its own, "
            "such as /var/lib/charly-arbiter",
        )


def _parse(path: Path, table: dict[str, Any]) -> Config:
    reader = _Reader(path)
    known = {
        "state_dir",
        "host",
        "libvirt_uri",
        "libvirt_preemption",
        "device_holder_policy",
        "console",
        "screen",
        "sleep",
        "hook_log",
        "timeouts",
        "tokens",
        "holders",
        "proxmox",
    }
    reader.no_unknown_keys(table, known, "")
    defaults = Config()
    timeouts_table = reader.get(table, "timeouts", dict, {})
    reader.no_unknown_keys(timeouts_table, set(Timeouts.__dataclass_fields__), "timeouts.")
    timeouts = Timeouts(
        **{
            name: reader.positive(timeouts_table, name, f"timeouts.{name}", default)
            for name, default in vars(Timeouts()).items()
        }
    )
    tokens = tuple(
        _parse_token(reader, name, spec)
        for name, spec in reader.get(table, "tokens", dict, {}).items()
    )
    token_names = {token.name for token in tokens}
    holders = tuple(
        _parse_holder(reader, index, spec, token_names)
        for index, spec in enumerate(reader.get(table, "holders", list, []))
    )
    hook_log = reader.get(table, "hook_log", str, "")
    if hook_log and not Path(hook_log).is_absolute():
        raise ConfigError(path, "hook_log", f"{hook_log!r} is not an absolute path")
    return Config(
        path=path,
        state_dir=Path(reader.get(table, "state_dir", str, str(defaults.state_dir))),
        host=reader.get(table, "host", str, defaults.host),
        libvirt_uri=reader.text(table, "libvirt_uri", defaults.libvirt_uri),
        libvirt_preemption=reader.choice(table, "libvirt_preemption", Preemption),
        process_policy=reader.choice(table, "device_holder_policy", ProcessPolicy),
        console=reader.choice(table, "console", ConsolePolicy),
        screen=reader.choice(table, "screen", ScreenPolicy),
        sleep=reader.choice(table, "sleep", SleepPolicy),
        hook_log=Path(hook_log) if hook_log else None,
        timeouts=timeouts,
        tokens=tokens,
        holders=holders,
        proxmox=_parse_proxmox(reader, reader.get(table, "proxmox", dict, {})),
    )


def _parse_proxmox(reader: _Reader, table: dict[str, Any]) -> ProxmoxConfig:
    reader.no_unknown_keys(table, PROXMOX_KEYS, "proxmox.")
    defaults = ProxmoxConfig()
    paths = {}
    for name in ("config_dir", "run_dir", "lock_dir", "qm", "pct"):
        value = reader.get(table, name, str, str(getattr(defaults, name)), f"proxmox.{name}")
        if not value.startswith("/") or not value.isprintable():
            raise ConfigError(reader.path, f"proxmox.{name}", f"{value!r} is not an absolute path")
        paths[name] = value
    node = reader.get(table, "node", str, "", "proxmox.node")
    if node and _NODE_NAME.fullmatch(node) is None:
        raise ConfigError(reader.path, "proxmox.node", f"{node!r} is not a Proxmox node name")
    return ProxmoxConfig(
        config_dir=Path(paths["config_dir"]),
        run_dir=Path(paths["run_dir"]),
        lock_dir=Path(paths["lock_dir"]),
        qm=paths["qm"],
        pct=paths["pct"],
        node=node,
        preemption=reader.choice(table, "preemption", Preemption, "proxmox.preemption"),
    )


def _parse_token(reader: _Reader, name: str, spec: Any) -> TokenConfig:
    key = f"tokens.{name}"
    if not isinstance(spec, dict):
        raise ConfigError(reader.path, key, "expected a table with an address")
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(reader.path, key, "a token name may only use letters, digits, - _ .")
    reader.no_unknown_keys(
        spec,
        {"address", "home_driver", "cdi", "cdi_devices", "console", "screen", "vfs", "vgpu_type"},
        f"{key}.",
    )
    address = reader.get(spec, "address", str, None, f"{key}.address")
    if address is None:
        raise ConfigError(reader.path, f"{key}.address", "is missing")
    try:
        parse_address(address)
    except ArbiterError as error:
        raise ConfigError(reader.path, f"{key}.address", str(error)) from None
    home_driver = reader.get(spec, "home_driver", str, None, f"{key}.home_driver")
    if home_driver is not None and not is_driver_name(home_driver):
        raise ConfigError(
            reader.path,
            f"{key}.home_driver",
            f"{home_driver!r} is not a kernel driver name (letters, digits, - and _)",
        )
    cdi_devices = reader.get(spec, "cdi_devices", list, [], f"{key}.cdi_devices")
    for device in cdi_devices:
        if not isinstance(device, str) or _CDI_NAME.fullmatch(device) is None:
            raise ConfigError(
                reader.path,
                f"{key}.cdi_devices",
                f"{device!r} is not a CDI device name (vendor.com/class=name)",
            )
    vgpu_type = spec.get("vgpu_type")
    if vgpu_type is not None:
        if isinstance(vgpu_type, int) and not isinstance(vgpu_type, bool) and vgpu_type > 0:
            vgpu_type = str(vgpu_type)
        elif not isinstance(vgpu_type, str) or not vgpu_type.strip().isprintable():
            raise ConfigError(
                reader.path, f"{key}.vgpu_type", "expected a vGPU type's ID or its name"
            )
    vfs = reader.get(spec, "vfs", int, None, f"{key}.vfs")
    if vfs is not None and not 0 <= vfs < 2**16:
        raise ConfigError(reader.path, f"{key}.vfs", f"{vfs} is not a VF count (0 to 65535)")
    return TokenConfig(
        name=name,
        address=address,
        home_driver=home_driver,
        cdi=reader.get(spec, "cdi", bool, True, f"{key}.cdi"),
        console=reader.choice(spec, "console", ConsolePolicy, f"{key}.console")
        if "console" in spec
        else None,
        screen=reader.choice(spec, "screen", ScreenPolicy, f"{key}.screen")
        if "screen" in spec
        else None,
        cdi_devices=tuple(cdi_devices),
        vfs=vfs,
        vgpu_type=vgpu_type,
    )


def is_driver_name(name: str) -> bool:
    """A kernel driver's name as it appears under /sys/bus/pci/drivers."""
    return 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "-_") for c in name)


def _parse_holder(
    reader: _Reader, index: int | None, spec: Any, tokens: set[str], attached: Path | None = None
) -> HolderConfig:
    key = "" if index is None else f"holders[{index}]"
    prefix = f"{key}." if key else ""
    if not isinstance(spec, dict):
        raise ConfigError(reader.path, key or None, "expected a table")
    reader.no_unknown_keys(spec, HOLDER_KEYS | (ATTACHED_KEYS if attached else set()), prefix)
    kind = reader.get(spec, "kind", str, "", f"{prefix}kind")
    if kind not in LISTED_KINDS:
        raise ConfigError(
            reader.path, f"{prefix}kind", f"expected one of {', '.join(LISTED_KINDS)}"
        )
    name = reader.get(spec, "name", str, "", f"{prefix}name")
    try:
        ref = Claimant.parse(f"{kind}:{name}")
    except ArbiterError as error:
        raise ConfigError(reader.path, f"{prefix}name", str(error)) from None
    held = reader.get(spec, "tokens", list, [], f"{prefix}tokens")
    for token in held:
        if not isinstance(token, str):
            raise ConfigError(reader.path, f"{prefix}tokens", "expected a list of token names")
        if tokens and token not in tokens:
            raise ConfigError(
                reader.path, f"{prefix}tokens", f"{token!r} is not a configured token"
            )
    stop = reader.get(spec, "stop", str, "stop", f"{prefix}stop")
    allowed = ("shutdown", "managedsave") if kind == HolderKind.LIBVIRT else ("stop", "drain")
    if stop == "stop" and kind == HolderKind.LIBVIRT:
        stop = "shutdown"
    if stop not in allowed:
        raise ConfigError(reader.path, f"{prefix}stop", f"expected one of {', '.join(allowed)}")
    runtime = reader.get(spec, "runtime", str, "podman", f"{prefix}runtime")
    if runtime not in ("podman", "docker"):
        raise ConfigError(reader.path, f"{prefix}runtime", "expected podman or docker")
    drain = reader.command(spec, "drain", f"{prefix}drain")
    if stop == "drain" and not drain:
        raise ConfigError(
            reader.path, f"{prefix}stop", '"drain" needs a drain command (the drain key)'
        )
    mode = reader.get(spec, "mode", str, "shared", f"{prefix}mode")
    if mode not in ("shared", "exclusive"):
        raise ConfigError(reader.path, f"{prefix}mode", "expected shared or exclusive")
    dropin = reader.get(spec, "dropin", str, "", f"{prefix}dropin")
    if dropin and not Path(dropin).is_absolute():
        raise ConfigError(reader.path, f"{prefix}dropin", f"{dropin!r} is not an absolute path")
    return HolderConfig(
        ref=ref,
        tokens=tuple(str(token) for token in held),
        preemptible=reader.get(spec, "preemptible", bool, False, f"{prefix}preemptible"),
        stop=stop,
        runtime=runtime,
        drain=drain,
        ready=reader.command(spec, "ready", f"{prefix}ready"),
        attached=attached,
        mode=mode,
        dropin=Path(dropin) if dropin else None,
    )


def attached_text(holder: HolderConfig) -> str:
    """The attached.d file `attach` writes for `holder`: the keys `_parse_holder` reads.

    Strings are written as JSON strings, which are TOML basic strings too.
    """
    lines = [
        f"# Written by charly-arbiter's attach; {cli_command('detach', operands=[holder.ref])} "
        "removes",
        "# it and its drop-in.  The keys of a [[holders]] table in arbiter.toml, plus how the",
        "# unit claims (mode) and where its drop-in is.",
        f"kind = {json.dumps(holder.ref.kind)}",
        f"name = {json.dumps(holder.ref.name)}",
        f"tokens = [{', '.join(json.dumps(token) for token in holder.tokens)}]",
        f"preemptible = {'true' if holder.preemptible else 'false'}",
        f"mode = {json.dumps(holder.mode)}",
    ]
    if holder.dropin is not None:
        lines.append(f"dropin = {json.dumps(str(holder.dropin))}")
    for key, command in (("drain", holder.drain), ("ready", holder.ready)):
        if command:
            lines.append(f"{key} = [{', '.join(json.dumps(part) for part in command)}]")
    if holder.stop != "stop":
        lines.append(f"stop = {json.dumps(holder.stop)}")
    return "\n".join(lines) + "\n"


def _with_attached(config: Config) -> Config:
    """arbiter.toml's holders, then one from each attached.d/*.toml file.

    Each file is checked like the configuration (a root-owned regular file) and
    validated like a [[holders]] table; a holder listed twice is an error.
    """
    directory = config.attached_dir
    try:
        paths = sorted(directory.glob("*.toml")) if directory.is_dir() else []
    except OSError as error:
        raise ConfigError(directory, None, f"cannot be read ({error.strerror})") from error
    if not paths:
        return config
    token_names = {token.name for token in config.tokens}
    holders = list(config.holders)
    for path in paths:
        holder = _parse_holder(_Reader(path), None, _read_table(path), token_names, path)
        listed = next((h for h in holders if h.ref == holder.ref), None)
        if listed is not None:
            where = listed.attached or config.path or "arbiter.toml"
            raise ConfigError(path, "name", f"{holder.ref} is listed in {where} already")
        holders.append(holder)
    return replace(config, holders=tuple(holders))


def sim_directory(host: str | None) -> Path | None:
    """DIR of a `sim:DIR` host spec (None for any other)."""
    if host is None or not host.startswith("sim:") or len(host) <= 4:
        return None
    return Path(host.removeprefix("sim:"))


def _absolute_sim(host: str | None) -> str | None:
    """`sim:DIR` with DIR made absolute and normal (a relative one means the working
    directory of the command that named it, not of a process it starts)."""
    directory = sim_directory(host)
    if directory is None:
        return host
    return f"sim:{os.path.normpath(directory.absolute())}"


def _check_host_spec(config: Config) -> None:
    where = config.path or "--host"
    if config.host == "local":
        return
    if config.host.startswith("sim:") and len(config.host) > 4:
        return
    raise ConfigError(where, "host", f"{config.host!r} is not `local` or `sim:DIR`")


class _Reader:
    """Typed look-ups that name the file and the key in every error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get(
        self, table: dict[str, Any], name: str, kind: type, default: Any, key: str | None = None
    ) -> Any:
        if name not in table:
            return default
        value = table[name]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(self.path, key or name, f"expected {_type_word(kind)}")
        return value

    def positive(self, table: dict[str, Any], name: str, key: str, default: float) -> float:
        value = table.get(name, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not 0 < value <= MAX_SECONDS
        ):
            raise ConfigError(
                self.path, key, f"expected a number of seconds above 0 and at most {MAX_SECONDS:g}"
            )
        return float(value)

    def text(self, table: dict[str, Any], name: str, default: str) -> str:
        """A string without control characters (it ends up in messages and argv)."""
        value = self.get(table, name, str, default)
        if not value or not value.isprintable():
            raise ConfigError(
                self.path, name, "expected a non-empty string without control characters"
            )
        return str(value)

    def command(self, table: dict[str, Any], name: str, key: str) -> tuple[str, ...]:
        """An argv: a list of strings, the program an absolute path (no shell runs it)."""
        value = self.get(table, name, list, [], key)
        if not value:
            return ()
        if not all(isinstance(part, str) and part.isprintable() for part in value):
            raise ConfigError(
                self.path, key, "expected a list of strings without control characters"
            )
        if not value[0].startswith("/"):
            raise ConfigError(
                self.path, key, f"{value[0]!r}: the program must be an absolute path (no shell)"
            )
        return tuple(value)

    def choice(self, table: dict[str, Any], name: str, choices: type[C], key: str = "") -> C:
        """One of the enum's values (its first when the key is not set)."""
        values = list(choices)
        value = table.get(name, values[0])
        if value not in values:
            raise ConfigError(self.path, key or name, f"expected one of {', '.join(values)}")
        return choices(value)

    def no_unknown_keys(self, table: dict[str, Any], known: set[str], prefix: str) -> None:
        for name in table:
            if name not in known:
                raise ConfigError(self.path, f"{prefix}{name}", "is not a known setting")


def _type_word(kind: type) -> str:
    return {str: "a string", bool: "true or false", dict: "a table", list: "a list"}.get(
        kind, kind.__name__
    )
