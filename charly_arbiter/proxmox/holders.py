"""Proxmox guests as holders: other VMs through `qm`, containers through `pct`.

Found by reading their configuration files (`/etc/pve/qemu-server/*.conf` and
`/etc/pve/lxc/*.conf`, this node's guests): reading pmxcfs takes no guest's
lock, whereas qemu-server and pve-container hold a guest's configuration lock
(a flock) while its hookscript runs, and a `qm` call that takes that lock
waits on the hook.  So, as for libvirt domains (docs/libvirt.md, the five
rules), and checked against qemu-server's source (docs/proxmox.md):

1. Never the guest the hook is about (`subject`), and no command that
   enumerates guests through their locks: the files are listed, and `qm
   status` (which takes no lock) is asked only about guests that hold a token.
2. The ledger lock is never held here (the arbiter calls in without it).
3. Every command is bounded (`timeouts.holder_stop` / `holder_start`, and
   `timeouts.libvirt_call` for a status query); a guest whose status cannot be
   read counts as running.
4. Depth one: before `qm shutdown`/`qm start` (or `pct …`) a marker says the
   arbiter is acting on that guest; the guest's own hookscript, which Proxmox
   runs nested (`pre-stop` inside `qm shutdown`, `pre-start` inside `qm
   start`), sees it and never stops or starts anything itself.
5. A guest whose own hook runs now is taken as running and never queried,
   stopped or started meanwhile.

VMIDs are validated integers before they become an argument or a path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import UNKNOWN_FUNCTION, Holder, TokenSpec
from charly_arbiter.core.model import Claimant, HolderKind, ProcessRef
from charly_arbiter.errors import ArbiterError, CommandFailed, HolderError
from charly_arbiter.host import run
from charly_arbiter.host.markers import ACTING_DIR, in_hook, marked
from charly_arbiter.host.procscan import DeviceNumber, process_alive
from charly_arbiter.host.sysfs import HOST_ROOTS, Roots
from charly_arbiter.proxmox.claims import ProxmoxNode, VmClaim, vm_claim
from charly_arbiter.proxmox.mapping import read_mappings, read_reservations
from charly_arbiter.proxmox.vmconf import (
    GuestConfig,
    container_devices,
    parse_ct_config,
    parse_override,
    parse_vm_config,
    read_config_file,
)

log = logging.getLogger(__name__)

VM_KIND = HolderKind.PROXMOX
CT_KIND = HolderKind.LXC
VM_DIR = "qemu-server"
CT_DIR = "lxc"
POLL_SECONDS = 0.2
WALK_DEPTH = 2  # /dev/dri/renderD128: a directory source is searched this deep


def vm_config_path(config: Config, vmid: str) -> Path:
    return config.proxmox.config_dir / VM_DIR / f"{vmid}.conf"


def ct_config_path(config: Config, vmid: str) -> Path:
    return config.proxmox.config_dir / CT_DIR / f"{vmid}.conf"


def proxmox_node(config: Config, roots: Roots = HOST_ROOTS) -> ProxmoxNode:
    """The cluster's mappings and this node's reservations, read when asked (a
    reservation's process is looked for under `roots.proc`)."""
    settings = config.proxmox
    return ProxmoxNode(
        node=settings.node_name,
        mappings=lambda: read_mappings(settings.config_dir),
        reservations=lambda: read_reservations(settings.run_dir),
        alive=lambda pid: process_alive(roots.proc, ProcessRef(pid)),
    )


@dataclass(frozen=True)
class DeviceNodes:
    """Where this host's /dev is, and which PCI function a character device is a
    node of (Host.device_functions): how a container's device lines become tokens."""

    root: Path
    functions: Callable[[Sequence[DeviceNumber]], Mapping[DeviceNumber, str]]


class _Guests:
    """What VMs and containers share: files, status, stop and start by their CLI."""

    kind = ""
    directory = ""
    noun = ""

    def __init__(self, config: Config, program: str, subject: str | None = None) -> None:
        """`subject` is the VMID whose hookscript this process runs in (None outside)."""
        self.config = config
        self.program = program
        self.subject = subject or None

    # -- HolderSource ------------------------------------------------------------------

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        names = {token.name for token in tokens}
        found = []
        for vmid in self._vmids():
            ref = Claimant.of(self.kind, vmid)
            try:
                held = self._held(vmid, tokens)
            except ArbiterError as error:
                log.warning("%s: ignored as a holder: %s", ref, error)
                continue
            if held is None:
                continue
            holds, preemptible, stop, detail = held
            holds = tuple(token for token in dict.fromkeys(holds) if token in names)
            if not holds:
                continue
            found.append(
                Holder(
                    ref=ref,
                    tokens=holds,
                    preemptible=preemptible,
                    running=self.is_running(ref),
                    how=f"{Path(self.program).name} {stop}",
                    detail=detail,
                    made_preemptible="give it the tag charly-preemptible (docs/proxmox.md)",
                )
            )
        return found

    def is_running(self, ref: Claimant) -> bool:
        vmid = self._vmid(ref)
        if vmid == self.subject or in_hook(self.config.state_dir, ref):
            return True  # starting or stopping: Proxmox holds it locked, alive for us
        if not self._config_path(vmid).exists():
            return False  # not a guest of this node (any more)
        return self._status(ref, vmid) != "stopped"

    def stop(self, ref: Claimant) -> None:
        vmid = self._refuse_subject(ref, "stop")
        if not self.is_running(ref):
            return
        method = self._stop_method(vmid)
        budget = self.config.timeouts.holder_stop
        if method == "stop":
            argv = [self.program, "stop", vmid]
        else:
            # forceStop: after the timeout, stop it hard (qemu-server/pve-container).
            argv = [
                self.program,
                "shutdown",
                vmid,
                "--timeout",
                str(int(budget)),
                "--forceStop",
                "1",
            ]
        with self.acting(ref):
            self._run(ref, "stop", argv, budget + 30)
            # An HA-managed guest's stop is only requested: wait for it.
            if not self._wait(ref, vmid, running=False, budget=budget):
                raise HolderError(
                    ref, "stop", f"it still runs after `{Path(self.program).name} {method}`"
                )

    def start(self, ref: Claimant) -> None:
        vmid = self._refuse_subject(ref, "start")
        if not self._config_path(vmid).exists():
            raise HolderError(ref, "start", f"this node has no {self.noun} {vmid}")
        if self.is_running(ref):
            return
        budget = self.config.timeouts.holder_start
        with self.acting(ref):
            self._run(ref, "start", [self.program, "start", vmid], budget + 30)
            if not self._wait(ref, vmid, running=True, budget=budget):
                raise HolderError(ref, "start", "it does not run after starting it")

    @contextlib.contextmanager
    def acting(self, ref: Claimant) -> Iterator[None]:
        """Depth one: the guest's own hookscript, run nested, sees this marker."""
        with marked(self.config.state_dir, ACTING_DIR, ref):
            yield

    # -- per kind ----------------------------------------------------------------------

    def _held(
        self, vmid: str, tokens: Sequence[TokenSpec]
    ) -> tuple[tuple[str, ...], bool, str, str] | None:
        """(tokens it uses, preemptible, how to stop it, why) or None."""
        raise NotImplementedError

    def _parse(self, data: bytes, guest: str, path: Path) -> GuestConfig:
        raise NotImplementedError

    # -- files and commands ---------------------------------------------------------------

    def _config_path(self, vmid: str) -> Path:
        return self.config.proxmox.config_dir / self.directory / f"{vmid}.conf"

    def _read(self, vmid: str) -> GuestConfig | None:
        path = self._config_path(vmid)
        guest = f"{self.kind}:{vmid}"
        data = read_config_file(path, guest)
        return None if data is None else self._parse(data, guest, path)

    def _vmids(self) -> list[str]:
        """This node's guests, by their files; never the hook's own, never one whose
        own hook runs now."""
        try:
            entries = os.listdir(self.config.proxmox.config_dir / self.directory)
        except OSError:
            return []  # not a Proxmox host, or no guests of this kind
        found = []
        for entry in entries:
            vmid = entry.removesuffix(".conf")
            if not entry.endswith(".conf") or not _valid_vmid(vmid) or vmid == self.subject:
                continue
            if in_hook(self.config.state_dir, f"{self.kind}:{vmid}"):
                continue
            found.append(vmid)
        return sorted(found, key=int)

    def _stop_method(self, vmid: str) -> str:
        try:
            config = self._read(vmid)
            stop = parse_override(config).stop if config is not None else None
        except ArbiterError:
            stop = None
        return stop or "shutdown"

    def _status(self, ref: Claimant, vmid: str) -> str:
        """`status: running|stopped|…` from `qm status` / `pct status`; a guest whose
        status cannot be read counts as running (it may hold the GPU)."""
        try:
            result = run.run(
                [self.program, "status", vmid], timeout=self.config.timeouts.libvirt_call
            )
        except CommandFailed as error:
            log.warning("%s: cannot read its status (%s); taken as running", ref, error)
            return "unknown"
        for line in result.stdout.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "status":
                return value.strip() or "unknown"
        log.warning("%s: `%s status` said no status; taken as running", ref, self.program)
        return "unknown"

    def _wait(self, ref: Claimant, vmid: str, *, running: bool, budget: float) -> bool:
        deadline = time.monotonic() + budget
        while True:
            if (self._status(ref, vmid) != "stopped") == running:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)

    def _run(self, ref: Claimant, action: str, argv: list[str], timeout: float) -> None:
        try:
            run.run(argv, timeout=timeout)
        except CommandFailed as error:
            raise HolderError(ref, action, str(error)) from error

    def _refuse_subject(self, ref: Claimant, action: str) -> str:
        vmid = self._vmid(ref)
        if vmid == self.subject:
            raise HolderError(ref, action, f"it is the {self.noun} this hookscript runs for")
        if in_hook(self.config.state_dir, ref):
            raise HolderError(ref, action, "its own hookscript is running; try again")
        return vmid

    def _vmid(self, ref: str) -> str:
        claimant = Claimant.parse(ref)
        if claimant.kind != self.kind:
            raise HolderError(ref, "handle", f"it is not a Proxmox {self.noun}")
        return claimant.name  # a validated VMID (core/model)


class ProxmoxHolders(_Guests):
    """Other VMs of this node, by their hostpci lines and override."""

    kind = VM_KIND
    directory = VM_DIR
    noun = "VM"

    def __init__(
        self, config: Config, subject: str | None = None, roots: Roots = HOST_ROOTS
    ) -> None:
        super().__init__(config, config.proxmox.qm, subject)
        self._node = proxmox_node(config, roots)

    def claim_of(self, vmid: str, tokens: Sequence[TokenSpec]) -> VmClaim | None:
        """A VM's claim as it runs now (its reserved mapping entry)."""
        config = self._read(vmid)
        if config is None:
            return None
        return vm_claim(vmid, config, tokens, self._node, running=True)

    def _parse(self, data: bytes, guest: str, path: Path) -> GuestConfig:
        return parse_vm_config(data, guest, path)

    def _held(
        self, vmid: str, tokens: Sequence[TokenSpec]
    ) -> tuple[tuple[str, ...], bool, str, str] | None:
        claim = self.claim_of(vmid, tokens)
        if claim is None:
            return None
        detail = f"{claim.mode} claim" + (f" ({', '.join(claim.devices)})" if claim.devices else "")
        return claim.tokens, claim.preemptible, claim.stop, detail


class LxcHolders(_Guests):
    """Containers of this node that are given a token's device nodes: `devN` lines,
    `lxc.mount.entry` lines binding a node (or a directory of them) from /dev, and
    `lxc.cgroup2.devices.allow` rules naming a GPU node's major (and minor)."""

    kind = CT_KIND
    directory = CT_DIR
    noun = "container"

    def __init__(self, config: Config, nodes: DeviceNodes) -> None:
        super().__init__(config, config.proxmox.pct, None)
        self.nodes = nodes

    def _parse(self, data: bytes, guest: str, path: Path) -> GuestConfig:
        return parse_ct_config(data, guest, path)

    def _held(
        self, vmid: str, tokens: Sequence[TokenSpec]
    ) -> tuple[tuple[str, ...], bool, str, str] | None:
        config = self._read(vmid)
        if config is None:
            return None
        override = parse_override(config)
        devices = container_devices(config)
        numbers: dict[DeviceNumber, str] = {}
        for path in devices.paths:
            for number in self._numbers_at(path):
                numbers.setdefault(number, path)
        for major, minor in devices.numbers:
            rule = f"c {major}:{'*' if minor is None else minor}"
            if minor is not None:
                numbers.setdefault((major, minor), rule)
            else:
                for number in self._numbers_with_major(major):
                    numbers.setdefault(number, rule)
        owner = {f.address: t.name for t in tokens for f in t.functions}
        held: dict[str, str] = {}
        for number, address in self.nodes.functions(list(numbers)).items():
            token = owner.get(address) if address != UNKNOWN_FUNCTION else None
            if token is not None:
                held.setdefault(token, numbers[number])
        for token in override.tokens:
            held.setdefault(token, "its charly-arbiter override")
        if not held:
            return None
        detail = "given " + "; ".join(f"{token} by {why}" for token, why in held.items())
        return tuple(held), bool(override.preemptible), override.stop or "shutdown", detail

    def cgroup_owner(self, paths: Sequence[str]) -> Claimant | None:
        """The container a process runs in: pve-container places a container's
        processes in the cgroup `lxc/CTID/ns` (lxc.cgroup.dir.container = lxc/CTID,
        .inner = ns; its monitor in lxc.monitor/CTID), so a process of the container
        holding the GPU's node is the container's, stopped with it, not a refusal."""
        for path in paths:
            parts = path.split("/")
            for index, part in enumerate(parts[:-1]):
                vmid = parts[index + 1]
                if part == "lxc" and _valid_vmid(vmid) and self._config_path(vmid).exists():
                    return Claimant.of(self.kind, vmid)
        return None

    def _numbers_at(self, path: str) -> list[DeviceNumber]:
        """The character devices at a /dev path of the host: the node, or those in the
        directory (searched WALK_DEPTH deep, symlinks not followed)."""
        target = self.nodes.root / path.removeprefix("/dev/")
        try:
            info = os.stat(target)
        except OSError:
            return []
        if stat.S_ISCHR(info.st_mode):
            return [(os.major(info.st_rdev), os.minor(info.st_rdev))]
        if stat.S_ISDIR(info.st_mode):
            return _walk(target, WALK_DEPTH)
        return []

    def _numbers_with_major(self, major: int) -> list[DeviceNumber]:
        return [number for number in _walk(self.nodes.root, WALK_DEPTH) if number[0] == major]


def _walk(directory: Path, depth: int) -> list[DeviceNumber]:
    found: list[DeviceNumber] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISCHR(info.st_mode):
            found.append((os.major(info.st_rdev), os.minor(info.st_rdev)))
        elif stat.S_ISDIR(info.st_mode) and depth > 1:
            found.extend(_walk(Path(entry.path), depth - 1))
    return found


def _valid_vmid(text: str) -> bool:
    return text.isascii() and text.isdigit() and text[0] != "0" and 3 <= len(text) <= 9
