"""`sim:DIR`, a file-backed simulated host (like libvirt's `test:///default`).

`DIR/host.toml` describes the machine: PCI devices and holders, with fault
injection flags (see docs/simulated-host.md).  What changes while it runs
(bound drivers, which holders run, the boot id) lives in `DIR/state.json`,
under its own lock, so that separate processes see each other's effects.
`host.toml` is read on every call, so a test can inject a fault mid-scenario.

A device may list device nodes (`nodes = ["dri/card1"]`), files under
`DIR/dev` that stand for its /dev nodes: real processes that hold one open are
found by the same /proc scan as on a real host (and always refuse a claim, as
with `device_holder_policy = "refuse"`), and a character device there is known
by its number, as a container runtime names it.

A device with `sriov_totalvfs` is an SR-IOV physical function: `write_sysfs`
models the kernel's `sriov_numvfs` and `sriov_drivers_autoprobe` (errors, the
VFs made and removed, a teardown that blocks while a VF's VFIO device is held),
and the VFs live in `state.json` only, so they are gone after `sim reboot`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
import tomllib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from charly_arbiter.core import files
from charly_arbiter.core.host import (
    NO_DRIVER,
    UNKNOWN_FUNCTION,
    Blocker,
    DeviceUser,
    Holder,
    MigChange,
    MigInstance,
    MigState,
    PciFunction,
    ScreenProcess,
    ScreenSession,
    ScreenUse,
    Sriov,
    TokenSpec,
    Vgpu,
    common_blocker,
    sriov_enabled_why,
    vgpu_type_of,
)
from charly_arbiter.core.model import (
    SCREEN_KINDS,
    VFIO,
    Claimant,
    ConsolePolicy,
    HolderKind,
    ProcessRef,
    target_label,
    user_unit,
)
from charly_arbiter.core.pci import vf_address
from charly_arbiter.errors import (
    DisplayManagerFailed,
    HolderError,
    HostError,
    MigFailed,
    MigInvalid,
    SwitchFailed,
    SwitchHung,
    VfCountFailed,
    VfCountHung,
    cli_command,
)
from charly_arbiter.host.blocking import TimedOut, bounded, errno_text
from charly_arbiter.host.procscan import (
    DeviceNumber,
    char_device_number,
    process_alive,
    process_ref,
)
from charly_arbiter.host.sysfs import HOST_ROOTS

if TYPE_CHECKING:
    from charly_arbiter.host.holders.process import OwnerOf, ProcessHolders

log = logging.getLogger(__name__)

BRIDGE_CLASS = "0604"
STATE_LOCK_WAIT = 60.0
LOG = "log.jsonl"  # the simulation's effects, a JSON string a line, in order
HANG_POLL = 0.05  # how often a blocked teardown looks whether its fault was lifted


class SimHost:
    def __init__(
        self, directory: Path, switch_timeout: float = 15.0, count_timeout: float | None = None
    ) -> None:
        self.directory = directory
        self.switch_timeout = switch_timeout
        # The watchdog of a write of sriov_numvfs (the switch timeout, unless a test that
        # makes switches hang in milliseconds wants the count's writes left alone).
        self.count_timeout = switch_timeout if count_timeout is None else count_timeout
        self.description = f"sim:{directory}"
        # Its device nodes are files under DIR/dev; its processes (the CLI, the hooks,
        # a process holding a node) are this machine's.
        self.roots = replace(HOST_ROOTS, dev=directory / "dev")
        self.dev_root = self.roots.dev
        self._parsed: tuple[tuple[int, int, int, int], dict[str, Any]] | None = None
        self._processes: ProcessHolders | None = None
        if not (directory / "host.toml").is_file():
            raise HostError(
                f"the simulated host {directory} has no host.toml",
                hint=f"run {cli_command('sim', 'init', operands=[str(directory)])} to create one",
            )

    # -- description and state ---------------------------------------------------

    def _description(self) -> dict[str, Any]:
        """host.toml, parsed again only when it changed (a test may inject a fault
        mid-scenario; a command asks a dozen times)."""
        path = self.directory / "host.toml"
        try:
            info = path.stat()
            key = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
            if self._parsed is None or self._parsed[0] != key:
                with path.open("rb") as handle:
                    self._parsed = (key, tomllib.load(handle))
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise HostError(f"cannot read the simulated host {path}: {error}") from error
        return self._parsed[1]

    def _devices(self) -> list[dict[str, Any]]:
        return list(self._description().get("devices", []))

    def _holder_specs(self) -> list[dict[str, Any]]:
        return list(self._description().get("holders", []))

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        """The mutable state, locked; written back atomically when the block ends (not
        durably: a simulation's state need not survive a power cut).

        `state["log"]` holds what the block adds to the log: lines appended to
        `DIR/log.jsonl` when it ends.  The log only grows, so it is kept out of
        state.json, which every call reads whole (a long run's log made each call
        re-read thousands of lines)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        lock = os.open(self.directory / "state.lock", flags, 0o644)
        try:
            if not files.lock_within(lock, STATE_LOCK_WAIT):
                raise HostError(f"{self.directory / 'state.lock'} stayed locked")
            path = self.directory / "state.json"
            text = _read_if_there(path)
            state = json.loads(text) if text else self._fresh_state()
            before = json.loads(text) if text else None
            # A state.json of an earlier version kept its log inside: moved out here.
            added: list[str] = list(before.pop("log", [])) if before is not None else []
            state["log"] = []
            yield state
            added += state.pop("log")
            if state != before:
                data = json.dumps(state, indent=1, sort_keys=True).encode()
                temp = path.with_suffix(".tmp")  # under the lock: a fixed name is safe
                temp.unlink(missing_ok=True)
                files.replace_file(path, data, temp=temp, durable=False)
            if added:
                with open(self.directory / LOG, "a", encoding="utf-8") as log_file:
                    log_file.write("".join(json.dumps(line) + "\n" for line in added))
        finally:
            os.close(lock)  # which lets the flock go

    def log(self) -> list[str]:
        """Every effect the simulation carried out, in order (`DIR/log.jsonl`)."""
        try:
            with open(self.directory / LOG, encoding="utf-8") as log_file:
                return [json.loads(line) for line in log_file]
        except FileNotFoundError:
            return []

    def _fresh_state(self) -> dict[str, Any]:
        return {
            "boot_id": _new_boot_id(),
            "drivers": {d["address"]: d.get("driver", "") for d in self._devices()},
            "running": {
                **{_ref(h): bool(h.get("running", False)) for h in self._holder_specs()},
                **{
                    self._unit_of(ref): True
                    for screen in self._screens()
                    for ref in _screen_refs(screen)
                    if self._unit_of(ref) == ref
                },
            },
            "unknown_alive": True,
            "cdi_generations": 0,
            "log": [],
            # SR-IOV: the VFs there are now (address -> physfn, index, group, the driver
            # they were created on), and each PF's sriov_drivers_autoprobe when not 1.
            "vfs": {},
            "autoprobe": {},
        }

    def snapshot(self) -> dict[str, Any]:
        """state.json's state, and the whole log under `log`."""
        with self._state() as state:
            copy: dict[str, Any] = json.loads(json.dumps(state))
            copy["log"] = self.log()
            return copy

    # -- Host interface ------------------------------------------------------------

    def boot_id(self) -> str:
        with self._state() as state:
            return str(state["boot_id"])

    def gpus(self) -> list[PciFunction]:
        return [f for f in self._functions() if f.is_display]

    def token_functions(self, name: str, address: str) -> list[PciFunction]:
        functions = self._functions()
        gpu = next((f for f in functions if f.address == address), None)
        if gpu is None:
            raise HostError(
                f"token {name}: there is no PCI device {address} on {self.description}",
                hint="check the token's address in arbiter.toml against the devices of "
                f"{self.directory / 'host.toml'}",
            )
        return [
            f
            for f in functions
            if f.address == address
            or (gpu.iommu_group is not None and f.iommu_group == gpu.iommu_group)
        ]

    def _functions(self) -> list[PciFunction]:
        with self._state() as state:
            drivers = dict(state["drivers"])
            vfs = dict(state.get("vfs", {}))
        result = []
        for device in [*self._devices(), *self._vf_devices(vfs)]:
            if str(device.get("class", "")).startswith(BRIDGE_CLASS):
                continue
            address = device["address"]
            driver = drivers.get(address) or None
            total = device.get("sriov_totalvfs")
            links = sorted((v["index"], a) for a, v in vfs.items() if v["physfn"] == address)
            result.append(
                PciFunction(
                    address=address,
                    vendor=str(device.get("vendor", "")),
                    device=str(device.get("device", "")),
                    pci_class=str(device.get("class", "")),
                    driver=driver,
                    iommu_group=_optional_str(device.get("iommu_group")),
                    # What this host's module index would bind it to (see LocalHost).
                    default_driver=_optional_str(device.get("default_driver"))
                    if driver in (None, VFIO)
                    else None,
                    physfn=device.get("physfn"),
                    vgpu=self._vgpu(address, driver, vfs),
                    sriov=Sriov(
                        int(total),
                        tuple(a for _, a in links),
                        int(device.get("sriov_offset", 1)),
                        int(device.get("sriov_stride", 1)),
                    )
                    if total
                    else None,
                )
            )
        return result

    def _vgpu_types(self, pf: str) -> dict[int, str]:
        device = next((d for d in self._devices() if d["address"] == pf), {})
        return {int(key): str(name) for key, name in device.get("vgpu_types", {}).items()}

    def _vgpu(self, address: str, driver: str | None, vfs: Mapping[str, Any]) -> Vgpu | None:
        """An NVIDIA vGPU VF's files (its PF lists `vgpu_types` and it is on nvidia), as
        NVIDIA's vGPU user guide lays them out (see core.host.Vgpu): every type is
        creatable while no VF of the GPU has one, then only the type the others have,
        and none on a VF that has a type."""
        vf = vfs.get(address)
        if vf is None or driver != "nvidia":
            return None
        types = self._vgpu_types(vf["pf"])
        if not types:
            return None
        current = int(vf.get("vgpu", 0))
        taken = {int(v.get("vgpu", 0)) for v in vfs.values() if v["pf"] == vf["pf"]} - {0}
        creatable = tuple(
            (type_id, name)
            for type_id, name in sorted(types.items())
            if not current and (not taken or type_id in taken)
        )
        return Vgpu(creatable, current)

    def _vf_devices(self, vfs: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The VFs as device entries: the PF's vendor and class, the VF device id."""
        pfs = {d["address"]: d for d in self._devices()}
        found = []
        for address, vf in sorted(vfs.items()):
            pf = pfs.get(vf["pf"], {})
            found.append(
                {
                    "address": address,
                    "vendor": pf.get("vendor", ""),
                    "device": pf.get("sriov_vf_device", pf.get("device", "")),
                    "class": pf.get("class", ""),
                    "driver": vf["driver"],
                    "iommu_group": vf["iommu_group"],
                    "physfn": vf["physfn"],
                }
            )
        return found

    def switch(self, token: TokenSpec, targets: Mapping[str, str]) -> None:
        with self._state() as state:
            vfs = dict(state.get("vfs", {}))
            autoprobe = dict(state.get("autoprobe", {}))
        devices = {d["address"]: d for d in [*self._devices(), *self._vf_devices(vfs)]}
        drivers_now = {f.address: f.driver for f in self._functions()}
        typed = {}  # address -> the vGPU type it gets (0: its type is cleared)
        for address, driver in targets.items():
            vgpu = self._vgpu(address, drivers_now.get(address), vfs)
            wanted = vgpu_type_of(driver)
            if wanted is not None:
                if vgpu is None:
                    raise SwitchFailed(address, driver, "current_vgpu_type", "ENOENT: no vGPU VF")
                if vgpu.current or all(wanted != type_id for type_id, _ in vgpu.creatable):
                    raise SwitchFailed(address, driver, "current_vgpu_type", "EINVAL")
                typed[address] = wanted
            elif vgpu is not None and vgpu.current:
                typed[address] = 0
            elif driver == VFIO and address in vfs and self._vgpu_types(vfs[address]["pf"]):
                raise SwitchFailed(address, VFIO, "verify", "no driver took the device (EINVAL)")
        for address, driver in targets.items():
            device = devices.get(address, {})
            enabled = [vf for vf, v in vfs.items() if v["pf"] == address]
            if driver == VFIO and enabled:
                # vfio-pci's probe: "Cannot bind to PF with SR-IOV enabled" (-EBUSY).
                raise SwitchFailed(address, VFIO, "verify", sriov_enabled_why(len(enabled)))
            if device.get("hang_switch"):
                # Like unbinding nvidia while something holds it: the write never returns.
                try:
                    bounded(lambda: time.sleep(3600), self.switch_timeout, f"sysfs {address}")
                except TimedOut:
                    raise SwitchHung(
                        address, target_label(driver), "unbind", self.switch_timeout
                    ) from None
            if device.get("fail_switch"):
                raise SwitchFailed(address, target_label(driver), "verify", "simulated failure")
        with self._state() as state:
            for address, type_id in typed.items():
                state["vfs"][address]["vgpu"] = type_id
                state["log"].append(f"vgpu {address} {type_id}")
            for address, driver in targets.items():
                if address in typed and vgpu_type_of(driver) is not None:
                    continue  # it stays on nvidia
                home = devices.get(address, {}).get("driver", "")
                new = driver if driver != NO_DRIVER else (home if home != VFIO else "")
                pf = vfs[address]["pf"] if address in vfs else None
                if pf is not None and driver == NO_DRIVER and not autoprobe.get(pf, True):
                    new = ""  # a VF is probed only with its PF's autoprobe on
                state["drivers"][address] = new
                state["log"].append(f"switch {address} {new or '(none)'}")
                if address in vfs:
                    node = self._vf_node(vfs[address]["iommu_group"])
                    if new == VFIO:
                        node.parent.mkdir(parents=True, exist_ok=True)
                        node.touch()
                    else:
                        node.unlink(missing_ok=True)
        for address, driver in sorted(targets.items()):
            if driver != VFIO and devices.get(address, {}).get("dead_at_home"):
                # Bound, but it does not answer (a reset it did not survive).
                raise SwitchFailed(
                    address, target_label(driver), "health check", "the device does not answer"
                )

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        return [*self.node_holders(tokens), *self.simulated_holders(tokens)]

    def managed_holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        return self.simulated_holders(tokens)

    def process_holders(
        self, tokens: Sequence[TokenSpec], running: Collection[Claimant]
    ) -> list[Holder]:
        """No simulated holder has real processes: each one holding a node is its own."""
        return self.node_holders(tokens)

    # -- device nodes ------------------------------------------------------------------

    def node_tokens(self, tokens: Sequence[TokenSpec]) -> dict[str, str]:
        """Each token's nodes under DIR/dev (those host.toml lists): path -> token."""
        nodes = {
            device["address"]: device.get("nodes", [])
            for device in self._devices()
            if device.get("nodes")
        }
        found: dict[str, str] = {}
        for token in tokens:
            for function in token.functions:
                for node in nodes.get(function.address, []):
                    found[str(self._node_path(node))] = token.name
                if function.physfn is not None and function.driver == VFIO:
                    found[str(self._vf_node(function.iommu_group))] = token.name
        return found

    def _vf_node(self, group: object) -> Path:
        """A VF on vfio-pci has DIR/dev/vfio/GROUP, as the kernel makes /dev/vfio/N: a
        real process that holds it open holds the VF (the way QEMU does)."""
        return self.dev_root / "vfio" / str(group)

    def _has_nodes(self) -> bool:
        return any(device.get("nodes") for device in self._devices()) or any(
            (self.dev_root / "vfio").glob("*")
        )

    def _node_path(self, node: Any) -> Path:
        relative = Path(str(node))
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise HostError(
                f"{self.directory / 'host.toml'}: node {node!r} is not a path under dev/"
            )
        return self.dev_root / relative

    def processes(self) -> ProcessHolders:
        if self._processes is None:
            from charly_arbiter.core.config import Config
            from charly_arbiter.host.holders.process import ProcessHolders

            self._processes = ProcessHolders(
                Config(), proc_root=self.roots.proc, nodes=self.node_tokens
            )
        return self._processes

    def node_holders(
        self, tokens: Sequence[TokenSpec], owner_of: OwnerOf | None = None
    ) -> list[Holder]:
        """Real processes holding the tokens' nodes (none when host.toml lists no nodes)."""
        if not self._has_nodes():
            return []
        return self.processes().holders(tokens, owner_of)

    def device_users(
        self, tokens: Sequence[TokenSpec], owner_of: OwnerOf | None = None
    ) -> list[DeviceUser]:
        if not self._has_nodes():
            return []
        return self.processes().users(tokens, owner_of)

    def device_functions(self, numbers: Sequence[DeviceNumber]) -> dict[DeviceNumber, str]:
        """The function whose listed node (a character device under DIR/dev) has each
        number; UNKNOWN_FUNCTION while that function is not on its own driver (on
        vfio-pci or unbound), as a real GPU's node then answers to no function."""
        wanted = set(numbers)
        with self._state() as state:
            drivers = dict(state["drivers"])
        found: dict[DeviceNumber, str] = {}
        for device in self._devices():
            for node in device.get("nodes", []):
                number = char_device_number(self._node_path(node))
                if number is not None and number in wanted:
                    bound = drivers.get(device["address"]) not in ("", VFIO, None)
                    found[number] = device["address"] if bound else UNKNOWN_FUNCTION
        return found

    # -- simulated holders -------------------------------------------------------------

    def simulated_holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        by_key: dict[str, str] = {}
        for token in tokens:
            by_key[token.name] = token.name
            for function in token.functions:
                by_key[function.address] = token.name
        with self._state() as state:
            running = dict(state["running"])
        found = []
        for spec in self._holder_specs():
            held = tuple(dict.fromkeys(by_key[t] for t in spec.get("tokens", []) if t in by_key))
            if not held:
                continue
            ref = _ref(spec)
            found.append(
                Holder(
                    ref=ref,
                    tokens=held,
                    preemptible=bool(spec.get("preemptible", False)),
                    running=bool(running.get(ref, False)),
                    how=str(spec.get("how", "stop")),
                    restartable=spec.get("kind") != "process",
                    # A simulated VM passes its GPU through unless host.toml says otherwise.
                    passthrough=bool(spec.get("passthrough", spec.get("kind") == "libvirt")),
                )
            )
        return found

    def is_running(self, ref: Claimant) -> bool:
        return self.are_running([ref])[ref]

    def are_running(self, refs: Sequence[Claimant]) -> dict[Claimant, bool]:
        with self._state() as state:
            running, unknown = state["running"], bool(state["unknown_alive"])
            return {
                ref: bool(running[unit]) if (unit := self._unit_of(ref)) in running else unknown
                for ref in refs
            }

    def stop(self, ref: Claimant) -> None:
        self._set_running(self._unit_of(ref), False, "fail_stop", "stop")

    def _unit_of(self, ref: Claimant) -> Claimant:
        """A display manager host.toml lists as a systemd holder is that holder: one
        unit, by either name (a `[[sessions]]` entry's display manager)."""
        ref = Claimant.parse(ref)
        if ref.kind is HolderKind.DISPLAY_MANAGER:
            unit = Claimant.of(HolderKind.SYSTEMD, ref.name)
            if self._spec(unit) is not None:
                return unit
        return ref

    def start(self, ref: Claimant) -> None:
        if Claimant.parse(ref).kind in SCREEN_KINDS:
            self._start_screen(Claimant.parse(ref))
            return
        spec = self._spec(ref)
        if spec is not None and spec.get("kind") == "process":
            log.info("%s was a process; there is nothing to start again", ref)
            return
        self._set_running(ref, True, "fail_start", "start")

    def _set_running(self, ref: Claimant, running: bool, fault: str, action: str) -> None:
        spec = self._spec(ref)
        if spec is not None and spec.get(fault):
            raise HolderError(ref, action, "simulated failure")
        with self._state() as state:
            state["running"][ref] = running
            state["log"].append(f"{action} {ref}")

    def _spec(self, ref: Claimant) -> dict[str, Any] | None:
        return next((s for s in self._holder_specs() if _ref(s) == ref), None)

    def screen(self, token: TokenSpec) -> ScreenUse:
        """A device's `boot_vga = true` makes it the boot display, `console = true` puts
        the framebuffer console on it, and each `[[sessions]]` entry on it is a logind
        session whose compositor holds its card (see docs/simulated-host.md): all of
        them only while the device is on its own driver, and a session only while its
        `display_manager`, where that is a simulated holder, runs."""
        addresses = {f.address for f in token.functions}
        with self._state() as state:
            drivers = dict(state["drivers"])
            running = dict(state["running"])
        devices = [d for d in self._devices() if d["address"] in addresses]
        home = {d["address"] for d in devices if drivers.get(d["address"]) not in ("", VFIO, None)}
        listed = {_ref(spec) for spec in self._holder_specs()}
        sessions: list[ScreenSession] = []
        processes: list[ScreenProcess] = []
        user_units: list[str] = []
        for spec in self._description().get("sessions", []):
            unit = _optional_str(spec.get("display_manager"))
            manager = Claimant.of("systemd", unit) if unit else None
            if spec.get("device") not in home:
                continue
            if manager is not None and manager in listed and not running.get(manager, False):
                continue
            session = _session(spec, unit)
            sessions.append(session)
            processes.append(
                ScreenProcess(
                    int(spec.get("pid", session.leader)),
                    str(spec.get("compositor", "compositor")),
                    session.uid,
                    tuple(str(n) for n in spec.get("nodes", ["card0"])),
                    session.id,
                    f"session-{session.id}.scope",
                )
            )
            user_units.extend(
                f"user@{session.uid}.service: {name}" for name in spec.get("user_units", [])
            )
        use = ScreenUse(
            token.name,
            boot_vga=any(d.get("boot_vga") for d in devices),
            fbcon=any(d.get("console") for d in devices if d["address"] in home),
            processes=tuple(processes),
            sessions=tuple(sessions),
            display_manager=next((s.display_manager for s in sessions if s.display_manager), None),
            user_units=tuple(dict.fromkeys(user_units)),
        )
        return self._desktop(use, home)

    # -- a desktop on a GPU: `[[screens]]` (a display manager, its sessions, user units) --

    def _screens(self) -> list[dict[str, Any]]:
        return list(self._description().get("screens", []))

    def _desktop(self, use: ScreenUse, home: Collection[str]) -> ScreenUse:
        """Who draws on the token's functions that are home, as `[[screens]]` describe
        them: the display manager's greeter while it runs with no session, each running
        session's compositor, each running user unit's process (its card held)."""
        with self._state() as state:
            running = dict(state["running"])
        # A session the arbiter ended is gone, whoever describes it (`[[sessions]]` too).
        ended = {
            s.id for s in use.sessions if not running.get(f"{HolderKind.SESSION}:{s.id}", True)
        }
        if ended:
            use = replace(
                use,
                sessions=tuple(s for s in use.sessions if s.id not in ended),
                processes=tuple(p for p in use.processes if p.session not in ended),
            )
        processes: list[ScreenProcess] = []
        sessions: list[ScreenSession] = []
        manager = None
        units: list[str] = []
        for screen in self._screens():
            if screen.get("address") not in home:
                continue
            unit = str(screen["display_manager"])
            dm_runs = running.get(
                str(self._unit_of(Claimant.of(HolderKind.DISPLAY_MANAGER, unit))), False
            )
            pid = 4000 + 100 * self._screens().index(screen)
            live = [
                item
                for item in screen.get("sessions", [])
                if running.get(str(Claimant.of(HolderKind.SESSION, str(item["id"]))), False)
            ]
            for index, item in enumerate(live):
                session = ScreenSession(
                    str(item["id"]),
                    "seat0",
                    str(item.get("type", "wayland")),
                    int(item.get("uid", 1000)),
                    str(item.get("user", "")),
                    pid + 10 * (index + 1),
                    unit,
                )
                sessions.append(session)
                processes.append(
                    ScreenProcess(
                        session.leader,
                        str(item.get("compositor", "weston")),
                        session.uid,
                        ("card0",),
                        session.id,
                        f"session-{session.id}.scope",
                    )
                )
            uid = (
                int(screen.get("sessions", [{}])[0].get("uid", 1000))
                if screen.get("sessions")
                else 1000
            )
            for index, name in enumerate(screen.get("user_units", [])):
                if running.get(str(user_unit(uid, str(name))), False):
                    units.append(f"user@{uid}.service: {name}")
                    processes.append(
                        ScreenProcess(
                            pid + 50 + index,
                            str(name).partition(".")[0][:15],
                            uid,
                            ("card0",),
                            None,
                            f"user@{uid}.service/app.slice/{name}",
                        )
                    )
            if dm_runs:
                manager = unit
                if not live:
                    processes.append(ScreenProcess(pid, "greeter", 0, ("card0",), None, unit))
        if not processes and manager is None:
            return use
        return replace(
            use,
            processes=(*use.processes, *processes),
            sessions=(*use.sessions, *sessions),
            display_manager=use.display_manager or manager,
            user_units=(*use.user_units, *units),
        )

    def _screen_of(self, ref: Claimant) -> dict[str, Any] | None:
        return next((s for s in self._screens() if ref in _screen_refs(s)), None)

    def _start_screen(self, ref: Claimant) -> None:
        """A session is never started again; a user unit is; the display manager comes
        up, or (`fail_start` in its `[[screens]]`) fails as the local host meets it:
        stopped, reset, and a text login on tty1 in its place."""
        screen = self._screen_of(ref)
        if ref.kind is HolderKind.SESSION:
            log.info("%s is a session: a session is not started again", ref)
            return
        unit = self._unit_of(ref)
        listed = self._spec(unit) if unit != ref else None
        failing = (screen or {}).get("fail_start") or (listed or {}).get("fail_start")
        if ref.kind is HolderKind.DISPLAY_MANAGER and failing:
            getty = "systemd:getty@tty1.service"
            with self._state() as state:
                state["running"][unit] = False
                state["running"][getty] = True
                state["log"] += [f"start {ref} failed", f"reset-failed {ref}", f"start {getty}"]
            raise DisplayManagerFailed(
                ref,
                ref.name,
                "it did not come up (simulated: fail_start)",
                (
                    f"{ref.name}: simulated failure",
                    f"{ref.name}: Failed with result 'exit-code'.",
                ),
                "tty1",
            )
        with self._state() as state:
            state["running"][unit] = True
            state["log"].append(f"start {ref}")

    def tell(self, sessions: Sequence[Claimant], message: str) -> None:
        with self._state() as state:
            state["log"] += [f"tell {session}: {message}" for session in sessions]

    def passthrough_blocker(self, token: TokenSpec) -> Blocker | None:
        """`iommu = false` or `vfio_pci = false` in host.toml model a host that
        cannot pass anything through; a device without `iommu_group` has none."""
        description = self._description()
        if not description.get("iommu", True):
            return Blocker(
                "the IOMMU is off (simulated: iommu = false)",
                "enable VT-d or AMD-Vi in the firmware and boot with intel_iommu=on",
            )
        blocker = common_blocker(token)
        if blocker is None and not description.get("vfio_pci", True):
            blocker = Blocker(
                "vfio-pci is neither loaded nor installed (simulated: vfio_pci = false)",
                "install the kernel's vfio-pci module",
            )
        addresses = {f.address for f in token.functions}
        console = [
            d["address"] for d in self._devices() if d.get("console") and d["address"] in addresses
        ]
        if blocker is None and console and token.console == ConsolePolicy.REFUSE:
            blocker = Blocker(
                f"it drives the host's display: the text console runs on it "
                f"(simulated: console = true on {', '.join(console)})",
                f'set `console = "release"` for {token.name} in arbiter.toml',
            )
        return blocker

    def current_process(self) -> ProcessRef:
        return process_ref(self.roots.proc, os.getpid()) or ProcessRef(os.getpid())

    def process_alive(self, process: ProcessRef) -> bool:
        return process_alive(self.roots.proc, process)

    def regenerate_cdi(self, token: TokenSpec) -> None:
        with self._state() as state:
            state["cdi_generations"] += 1
            state["log"].append(f"cdi {token.name}")

    def close(self) -> None:
        pass

    # -- sleep locks: logind's inhibitors, as the local host holds them --------------------

    def inhibit(self, token: str, why: str) -> None:
        """Hold `token`'s sleep lock (state.json's `sleep_locks`); `systemd = false` in
        host.toml models a host without systemd, which cannot hold one."""
        if not self._description().get("systemd", True):
            raise HostError(
                f"{token}: cannot block sleep: systemd is not running here "
                "(simulated: systemd = false)"
            )
        with self._state() as state:
            state.setdefault("sleep_locks", {})[token] = why
            state["log"].append(f"inhibit {token}")

    def uninhibit(self, token: str) -> None:
        with self._state() as state:
            if state.setdefault("sleep_locks", {}).pop(token, None) is not None:
                state["log"].append(f"uninhibit {token}")

    def inhibitors(self) -> dict[str, str]:
        with self._state() as state:
            return {str(token): str(why) for token, why in state.get("sleep_locks", {}).items()}

    def sleep_lock_unavailable(self) -> str | None:
        if not self._description().get("systemd", True):
            return "systemd is not running here (simulated: systemd = false)"
        return None

    # -- MIG: what NVML says and does, for a GPU with `mig_profiles` ------------------------

    def mig(self, token: TokenSpec) -> MigState | None:
        """NVML's MIG view of the GPU: host.toml's `mig_profiles` (profile -> its compute
        slices, of 7) make it MIG-capable; its mode and layout live in state.json."""
        gpus = [d for d in self._devices() if str(d.get("class", "")).startswith("03")]
        device = next((d for d in gpus if d["address"] == token.address), None)
        if device is None or not device.get("mig_profiles"):
            return None
        with self._state() as state:
            mig = dict(state.get("mig", {}).get(token.address, {}))
        layout = list(mig.get("layout", []))
        enabled = bool(mig.get("enabled", False))
        return MigState(
            enabled=enabled,
            pending=False,
            index=[d["address"] for d in gpus if d.get("vendor") == "10de"].index(token.address),
            instances=tuple(
                MigInstance(index, index + 1, 0, f"MIG-{token.address}-{index}", profile)
                for index, profile in enumerate(layout if enabled else [])
            ),
        )

    def set_mig(self, token: TokenSpec, change: MigChange) -> MigState:
        """nvmlDeviceSetMigMode and the instances' destroy and create, as NVML refuses
        them: while a client uses the GPU (a holder of its token runs), a layout
        while MIG is off, a profile it does not have, more slices than its 7."""
        before = self.mig(token)
        device = next(d for d in self._devices() if d["address"] == token.address)
        if before is None:
            raise MigInvalid(token.name, "it has no MIG (simulated: no mig_profiles)")
        running = [holder.ref for holder in self.simulated_holders([token]) if holder.running]
        if running or device.get("fail_mig"):
            why = f"In use by another client ({', '.join(running)})" if running else "simulated"
            raise MigFailed(token.address, str(change), why)
        profiles = {str(name): int(slices) for name, slices in device["mig_profiles"].items()}
        with self._state() as state:
            mig = state.setdefault("mig", {}).setdefault(token.address, {})
            if change.layout is None:
                mig["enabled"] = bool(change.enabled)
                mig["layout"] = []
            else:
                if not mig.get("enabled"):
                    raise MigInvalid(token.name, "MIG mode is off: turn it on first")
                unknown = [p for p in change.layout if p not in profiles]
                if unknown:
                    raise MigInvalid(token.name, f"it has no MIG profile {unknown[0]}")
                if sum(profiles[p] for p in change.layout) > 7:
                    raise MigFailed(token.address, str(change), "Insufficient Resources")
                mig["layout"] = list(change.layout)
            state["log"].append(f"mig {token.address} {change}")
        after = self.mig(token)
        assert after is not None
        return after

    # -- SR-IOV: the kernel's side of sriov_numvfs -------------------------------------

    def write_vf_count(self, address: str, count: int) -> None:
        """`write_sysfs` of `sriov_numvfs` under the watchdog, as the arbiter writes it."""
        try:
            bounded(
                lambda: self.write_sysfs(address, "sriov_numvfs", str(count)),
                self.count_timeout,
                f"sysfs {address} sriov_numvfs",
            )
        except TimedOut:
            raise VfCountHung(address, count, self.count_timeout) from None
        except OSError as error:
            raise VfCountFailed(address, count, errno_text(error)) from None

    def write_sysfs(self, address: str, attribute: str, text: str) -> None:
        """A write of `text` to bus/pci/devices/ADDRESS/ATTRIBUTE, as the kernel takes it
        (raises OSError with its errno); only SR-IOV's writable attributes are modelled.

        Like the kernel's, a write of `sriov_numvfs` can block: with the PF's
        `hang_sriov_teardown` set, writing 0 stops at the first VF on vfio-pci (its
        VFIO device held) until the flag is cleared in host.toml.  The caller bounds
        it, as the arbiter bounds every write that can block.
        """
        pf = next((d for d in self._devices() if d["address"] == address), None)
        if pf is None:
            raise OSError(errno.ENOENT, f"there is no PCI device {address}")
        if not pf.get("sriov_totalvfs") or attribute not in (
            "sriov_numvfs",
            "sriov_drivers_autoprobe",
        ):
            raise OSError(errno.EACCES, f"{address}/{attribute} cannot be written")
        if attribute == "sriov_drivers_autoprobe":
            flag = {"1": True, "y": True, "on": True, "0": False, "n": False, "off": False}
            value = flag.get(text.strip().lower())
            if value is None:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            with self._state() as state:
                state.setdefault("autoprobe", {})[address] = value
            return
        self._store_numvfs(pf, text)

    def _store_numvfs(self, pf: Mapping[str, Any], text: str) -> None:
        """sriov_numvfs_store (drivers/pci/iov.c), with the errnos seen on Linux 6.1."""
        address = pf["address"]
        try:
            count = int(text[:-1] if text.endswith("\n") else text, 0)
        except ValueError:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL)) from None
        if not 0 <= count < 2**16:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        if count > int(pf["sriov_totalvfs"]):
            raise OSError(errno.ERANGE, os.strerror(errno.ERANGE))
        with self._state() as state:
            vfs = state.setdefault("vfs", {})
            existing = sorted((v["index"], vf) for vf, v in vfs.items() if v["pf"] == address)
            if count == len(existing):
                return
            if not state["drivers"].get(address):
                raise OSError(errno.ENOENT, f"{address}: no driver bound; cannot configure SR-IOV")
            if count and existing:
                raise OSError(errno.EBUSY, f"{len(existing)} VFs already enabled; write 0 first")
            if count:
                self._enable_sriov(state, pf, count)
                return
        for _, vf in existing:
            self._remove_vf(vf, pf)
        with self._state() as state:
            state["log"].append(f"sriov {address} 0")

    def _enable_sriov(self, state: dict[str, Any], pf: Mapping[str, Any], count: int) -> None:
        address = pf["address"]
        autoprobe = state.get("autoprobe", {}).get(address, True)
        driver = str(pf.get("sriov_vf_driver", "")) if autoprobe else ""
        for index in range(count):
            vf = vf_address(address, index, pf.get("sriov_offset", 1), pf.get("sriov_stride", 1))
            taken = {str(d.get("iommu_group")) for d in self._devices()}
            taken |= {str(v["iommu_group"]) for v in state["vfs"].values()}
            group = next(str(n) for n in range(len(taken) + 1) if str(n) not in taken)
            state["vfs"][vf] = {
                "pf": address,
                "physfn": address,
                "index": index,
                "iommu_group": group,
                "driver": driver,
            }
            state["drivers"][vf] = driver
        state["log"].append(f"sriov {address} {count}")

    def _remove_vf(self, vf: str, pf: Mapping[str, Any]) -> None:
        """pci_iov_remove_virtfn: the links go first; a VF whose VFIO device is held
        blocks the removal there (its driver already unlinked) until it is let go."""
        with self._state() as state:
            held = state["drivers"].get(vf) == VFIO
            state["vfs"][vf]["physfn"] = None
            state["vfs"][vf]["index"] = -1  # its virtfn link is gone
            state["drivers"][vf] = ""
        if held:
            while self._hangs(pf["address"]):
                time.sleep(HANG_POLL)
        with self._state() as state:
            self._vf_node(state["vfs"][vf]["iommu_group"]).unlink(missing_ok=True)
            del state["vfs"][vf]
            del state["drivers"][vf]

    def _hangs(self, address: str) -> bool:
        device = next((d for d in self._devices() if d["address"] == address), {})
        return bool(device.get("hang_sriov_teardown"))

    # -- simulation controls (the `sim` commands) ----------------------------------------

    def set_running(self, ref: str, running: bool) -> None:
        """Change a holder or claimant from outside (a VM crashed, a unit was started)."""
        with self._state() as state:
            state["running"][ref] = running
            state["log"].append(f"{'up' if running else 'down'} {ref} (simulated)")

    def reboot(self) -> None:
        """A new boot: drivers and holders as described, every claimant gone."""
        with self._state() as state:
            # Claimants the simulation was told about are gone with the old boot;
            # claimants not yet seen (a VM claiming after the reboot) count as alive,
            # as on a fresh host.  Old leases are stranded by their boot id.
            fresh = self._fresh_state()
            for ref in state["running"]:
                fresh["running"].setdefault(ref, False)
            fresh["cdi_generations"] = state["cdi_generations"]
            fresh["log"] = [*state["log"], "reboot"]  # what this block adds
            for vf in state.get("vfs", {}).values():  # VFs do not survive a reboot
                self._vf_node(vf["iommu_group"]).unlink(missing_ok=True)
            state.clear()
            state.update(fresh)


def _read_if_there(path: Path) -> bytes:
    """The file's bytes, b"" when there is none."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def _new_boot_id() -> str:
    """A random id in the kernel's boot_id form (uuid would import platform: costly here)."""
    raw = os.urandom(16).hex()
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def _ref(spec: Mapping[str, Any]) -> Claimant:
    return Claimant.of(str(spec.get("kind", "")), str(spec.get("name", "")))


def _session(spec: Mapping[str, Any], display_manager: str | None) -> ScreenSession:
    try:
        return ScreenSession(
            id=str(spec["id"]),
            seat=_optional_str(spec.get("seat", "seat0")),
            type=str(spec.get("type", "wayland")),
            uid=int(spec.get("uid", 1000)),
            user=str(spec.get("user", "")),
            leader=int(spec.get("leader", 0)),
            display_manager=display_manager,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise HostError(f"a [[sessions]] entry of the simulated host is wrong: {error!r}") from None


def _screen_refs(screen: Mapping[str, Any]) -> list[Claimant]:
    """The holders one `[[screens]]` entry stands for."""
    sessions = list(screen.get("sessions", []))
    uid = int(sessions[0].get("uid", 1000)) if sessions else 1000
    return [
        Claimant.of(HolderKind.DISPLAY_MANAGER, str(screen["display_manager"])),
        *(Claimant.of(HolderKind.SESSION, str(item["id"])) for item in sessions),
        *(user_unit(uid, str(name)) for name in screen.get("user_units", [])),
    ]


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


EXAMPLE = """\
# A simulated host: one NVIDIA GPU with its HDMI audio function in IOMMU
# group 12, a second GPU alone in group 13, and the things that use them.
# See docs/simulated-host.md for every key.

[[devices]]
address = "0000:0a:00.0"
vendor = "10de"
device = "2684"
class = "030000"
driver = "nvidia"
iommu_group = 12

[[devices]]
address = "0000:0a:00.1"
vendor = "10de"
device = "22ba"
class = "040300"
driver = "snd_hda_intel"
iommu_group = 12

[[devices]]
address = "0000:0b:00.0"
vendor = "10de"
device = "2204"
class = "030000"
driver = "nvidia"
iommu_group = 13

# A container serving a model on the first GPU: it may be stopped for a VM.
[[holders]]
kind = "container"
name = "llm"
tokens = ["0000:0a:00.0"]
preemptible = true
running = true
how = "podman stop"

# The desktop session's display server on the second GPU: never stopped.
[[holders]]
kind = "systemd"
name = "display-manager.service"
tokens = ["0000:0b:00.0"]
preemptible = false
running = true
how = "systemctl stop"
"""
